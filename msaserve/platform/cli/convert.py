"""`msaserve convert`: a dense checkpoint in, an MSA checkpoint with a calibrated index out (CPU)."""

import argparse
import sys
from pathlib import Path

from pydantic import ValidationError

from msaserve.engine.checkpoint_convert import REPORT_FILE, CalibrationSettings, convert_checkpoint
from msaserve.engine.model_loading import (
    CheckpointMismatch,
    ModelFileMissing,
    UnsupportedModelType,
    validation_problems,
)
from msaserve.platform.cli.arg_types import positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert", help="convert a dense checkpoint to MSA with a calibrated index (CPU, minutes)",
        description="Writes OUT: config.json, model.safetensors (with each layer's learned index "
        f"projections), tokenizer files and {REPORT_FILE}. Serve it with `msaserve serve --model OUT`.",
    )
    parser.add_argument("--model", default="smollm2",
                        help="the dense source: smollm2 (default), a .gguf file or an HF checkpoint "
                        "directory")
    parser.add_argument("--out", required=True, type=Path, help="directory to write the MSA checkpoint to")
    parser.add_argument("--calibration-text", required=True, type=Path,
                        help="a text file to fit the index on (keep it apart from evaluation text)")
    parser.add_argument("--tokens", type=positive_int, default=4096,
                        help="calibration tokens, from the text's start (> top_k·page_size; default 4096)")
    parser.add_argument("--steps", type=positive_int, default=CalibrationSettings.steps,
                        help=f"optimiser steps per layer (default {CalibrationSettings.steps})")
    parser.add_argument("--top-k", type=positive_int, default=None,
                        help="blocks each query attends to (default: the source's conversion, 16 for GGUF)")
    parser.add_argument("--dense-layers", type=_layer_list, default=None,
                        help="layers that attend densely, e.g. '0-3' or '0,1,5' (default none)")
    parser.set_defaults(func=run)


def _layer_list(text: str) -> tuple[int, ...]:
    """'0-3' → (0, 1, 2, 3); '0,2,5' → (0, 2, 5); '' → ()."""
    layers: list[int] = []
    message = f"{text!r} is invalid: allowed layer ids ≥ 0 like '0-3' or '0,2,5', each range low-high"
    try:
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            first, last = int(lo), int(hi or lo)
            if first < 0 or last < first:  # '9-0' was an empty range: no dense layer, silently
                raise argparse.ArgumentTypeError(message)
            layers += range(first, last + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(message) from None
    return tuple(layers)


def run(args: argparse.Namespace) -> int:
    try:
        text = args.calibration_text.read_text()
    except OSError as err:
        print(f"error: --calibration-text {args.calibration_text}: {err}", file=sys.stderr)
        return 2
    settings = CalibrationSettings(steps=args.steps)
    try:
        overrides = {k: v for k, v in (("top_k", args.top_k), ("dense_layers", args.dense_layers))
                     if v is not None}
        reports = convert_checkpoint(args.model, args.out, text, args.tokens, settings, **overrides)
    except (ModelFileMissing, CheckpointMismatch, UnsupportedModelType, ValueError) as err:
        reason = validation_problems(err) if isinstance(err, ValidationError) else err
        print(f"error: {reason}", file=sys.stderr)
        return 2
    before = sum(r.loss_before for r in reports) / len(reports)
    after = sum(r.loss_after for r in reports) / len(reports)
    rec = {k: sum(r.recall[k] for r in reports) / len(reports) for k in reports[0].recall}
    rec["written"] = sum(r.recall["calibrated" if r.kept else "keys"] for r in reports) / len(reports)
    kept = sum(r.kept for r in reports)
    recalls = ", ".join(f"{k} {v:.3f}" for k, v in rec.items())
    print(f"wrote {args.out}: distillation loss {before:.4f} → {after:.4f} (mean over {len(reports)} "
          f"layers; the fit kept in {kept}); held-out attention-mass recall {recalls}")
    return 0
