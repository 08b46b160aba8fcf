"""Calibrated MSA index and `msaserve convert` on the tiny preset made dense (index_source 'keys')."""

import json

import pytest
import torch
from reference_decode import SequenceState, step_metadata

from msaserve.models.convert import REPORT_FILE
from msaserve.models.index_calibration import (
    CalibrationSettings,
    IndexCalibrator,
    calibrate,
    initial_index,
    prepare_layer,
)
from msaserve.models.loader import load_model
from msaserve.models.safetensors_loader import save_safetensors
from msaserve.platform.cli import main as cli_main

DENSE_TINY = dict(
    index_source="keys", num_index_heads=2, vision=None, image_token_id=None, video_token_id=None
)
SETTINGS = CalibrationSettings(steps=25, queries_per_step=64, eval_queries=128, learning_rate=1e-2)


def _dense_tiny(seed: int = 0):
    return load_model("tiny", attention_backend="msa", progress=False, seed=seed, **DENSE_TINY)


def _tokens(count: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 500, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def test_initial_index_is_the_training_free_conversion() -> None:
    """Before fitting, the learned branch selects exactly what index_source='keys' selects."""
    dense = _dense_tiny().model
    learned = initial_index(dense)
    assert learned.config.index_source == "learned"
    ids = _tokens(300)
    outputs = []
    for model in (dense, learned):
        state = SequenceState(model, len(ids))
        meta = step_metadata(0, len(ids), state.max_pages, model.config.page_size, False, torch.device("cpu"))
        outputs.append((model(torch.tensor(ids), meta, state.caches), meta.selections))
    (h_dense, sel_dense), (h_learned, sel_learned) = outputs
    assert len(sel_dense) == 2 and all(torch.equal(a, b) for a, b in zip(sel_dense, sel_learned, strict=True))
    torch.testing.assert_close(h_dense, h_learned, atol=1e-5, rtol=1e-5)


def test_calibration_reduces_the_distillation_loss() -> None:
    """On random weights scaled so that attention is peaked (a trained model's is; N(0, 0.02)
    weights give near-uniform attention and nothing to distil)."""
    dense = _dense_tiny().model
    with torch.no_grad():
        for layer in dense.layers:
            layer.self_attn.q_proj.weight.mul_(30.0)
            layer.self_attn.k_proj.weight.mul_(30.0)
    model = initial_index(dense)
    before = [layer.self_attn.index_q_proj.weight.clone() for layer in model.layers]
    reports = calibrate(model, [_tokens(512)], SETTINGS, progress=False)
    assert len(reports) == model.config.num_layers
    for report, old, layer in zip(reports, before, model.layers, strict=True):
        assert report.loss_after < report.loss_before, report
        assert set(report.recall) == {"keys", "calibrated", "quest"}
        assert all(0.0 <= v <= 1.0 + 1e-5 for v in report.recall.values())
        # The fit is in the model where it selects at least as well as the training-free index.
        assert torch.equal(old, layer.self_attn.index_q_proj.weight) != report.kept


def test_calibration_needs_a_window_longer_than_the_forced_blocks() -> None:
    model = initial_index(_dense_tiny().model)
    calibrator = IndexCalibrator(model, SETTINGS)
    with pytest.raises(ValueError, match="calibration window of 64 tokens is invalid"):
        calibrator.fit_layer(0, prepare_layer(model, 0, torch.randn(64, model.config.hidden_size)))


def test_convert_writes_a_checkpoint_that_loads_and_serves(tmp_path, capsys) -> None:
    source, out = tmp_path / "dense", tmp_path / "msa"
    dense = _dense_tiny(seed=3).model
    save_safetensors(dense, source)
    text = tmp_path / "calibration.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    argv = ["convert", "--model", str(source), "--out", str(out), "--calibration-text", str(text),
            "--tokens", "400", "--steps", "5", "--dense-layers", "1", "--top-k", "3"]
    assert cli_main(argv) == 0
    assert "distillation loss" in capsys.readouterr().out
    report = json.loads((out / REPORT_FILE).read_text())
    assert len(report["layers"]) == 2 and report["calibration_tokens"] == 400
    loaded = load_model(str(out), progress=False)
    assert loaded.config.index_source == "learned" and loaded.config.num_index_heads == 2
    assert loaded.config.dense_layers == (1,) and loaded.config.top_k == 3
    # The dense weights came through unchanged, beside the fitted index projections.
    torch.testing.assert_close(loaded.model.layers[1].mlp.up_proj.weight, dense.layers[1].mlp.up_proj.weight)
    assert cli_main(["generate", "--model", str(out), "--prompt", "hello", "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()


def test_convert_rejects_a_model_with_a_learned_index(tmp_path, capsys) -> None:
    text = tmp_path / "t.txt"
    text.write_text("x" * 500)
    argv = ["convert", "--model", "tiny", "--out", str(tmp_path / "o"), "--calibration-text", str(text)]
    assert cli_main(argv) == 2
    assert "already has a learned MSA index" in capsys.readouterr().err


def test_calibration_fits_even_when_the_caller_turned_autograd_off() -> None:
    """`msaserve generate` run in-process used to switch autograd off for the whole process; the
    fit then failed with 'element 0 of tensors does not require grad' (seen in the full suite)."""
    previous = torch.is_grad_enabled()
    torch.set_grad_enabled(False)
    try:
        test_calibration_reduces_the_distillation_loss()
    finally:
        torch.set_grad_enabled(previous)


def test_convert_names_bad_dense_layers(tmp_path, capsys) -> None:
    """'9-0' was an empty range (no dense layer, silently); a layer past the model was pydantic's dump."""
    source = tmp_path / "dense"
    save_safetensors(_dense_tiny(seed=3).model, source)
    text = tmp_path / "calibration.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    argv = ["convert", "--model", str(source), "--out", str(tmp_path / "o"), "--calibration-text", str(text),
            "--tokens", "400", "--steps", "1", "--top-k", "3", "--dense-layers"]
    with pytest.raises(SystemExit):
        cli_main([*argv, "1-0"])
    assert "'1-0' is invalid: allowed layer ids ≥ 0" in capsys.readouterr().err
    assert cli_main([*argv, "0-5"]) == 2
    err = capsys.readouterr().err
    assert "dense_layers=[0, 1, 2, 3, 4, 5] is invalid" in err and "validation error" not in err, err
