"""Convert a dense checkpoint (HF safetensors directory, GGUF, or 'smollm2') into an MSA checkpoint
directory with a calibrated index (`index_calibration.py`): config.json (index_source 'learned'),
model.safetensors (the dense weights plus each layer's index_q_proj / index_k_proj), tokenizer.json
(+ tokenizer_config.json with the chat template) and msa_calibration.json (what the fit achieved).
`load_model(directory)` — and so `msaserve serve --model DIRECTORY` — loads it like any checkpoint.
"""

import json
import sys
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from msaserve.models.index_calibration import CalibrationSettings, LayerReport, calibrate, initial_index
from msaserve.models.loader import load_model
from msaserve.models.safetensors_loader import save_safetensors

REPORT_FILE = "msa_calibration.json"


def convert_checkpoint(
    source: str,
    out_dir: str | Path,
    calibration_text: str,
    window_tokens: int = 4096,
    settings: CalibrationSettings | None = None,
    progress: bool = True,
    **overrides: object,
) -> list[LayerReport]:
    """Write the calibrated MSA checkpoint of dense `source` into `out_dir`; the index is fitted on
    the first `window_tokens` tokens of `calibration_text`. overrides: MSA fields of the conversion
    (page_size, top_k, n_init, n_local, where the source's loader takes them; top_k, n_init,
    n_local and dense_layers for any source)."""
    settings = settings or CalibrationSettings()
    loaded = load_model(source, attention_backend="msa", progress=progress, **overrides)
    c = loaded.config
    if c.index_source == "learned":
        raise ValueError(f"model {source!r} already has a learned MSA index (index_source='learned'): "
                         "convert takes a dense checkpoint")
    model = initial_index(loaded.model, overrides)  # also where the source's loader took no overrides
    c = model.config
    ids = loaded.tokenizer.encode(calibration_text)[:window_tokens]
    minimum = c.top_k * c.page_size + 1
    if len(ids) < minimum:
        raise ValueError(f"calibration text gives {len(ids)} tokens: allowed ≥ top_k·P + 1 = {minimum}")
    if progress:
        print(f"calibrating the index of {c.num_layers} layers on {len(ids)} tokens", file=sys.stderr)
    reports = calibrate(model, [ids], settings, progress=progress)
    out = Path(out_dir)
    save_safetensors(model, out)
    loaded.tokenizer.backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": loaded.tokenizer.chat_template}))
    summary = {
        "source": source, "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "calibration_tokens": len(ids), "settings": asdict(settings),
        "layers": [asdict(r) for r in reports],
    }
    (out / REPORT_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return reports
