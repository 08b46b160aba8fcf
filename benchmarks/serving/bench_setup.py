"""Sizes and engines of the offline serving benchmark (`offline.py`), shared by its parts."""

import argparse
import gc
from dataclasses import dataclass

import torch

from msaserve.engine.config import EngineConfig
from msaserve.engine.llm_engine import LLMEngine

# Measurement window per (backend, level) of the traffic parts, in seconds. On the GPU the two
# traffic parts make 2 backends × 3 levels × 2 workloads = 12 windows: 12 × 25 s plus two engine
# builds and warm-ups fits one 7-minute run.
GPU_WINDOW_S = 25.0
GPU_QUICK_WINDOW_S = 8.0


@dataclass
class Sizes:
    """Workload sizes: the GPU ones from the issue, or scaled down for the CPU."""

    preset: str
    session_len: int
    session_decode: int
    session_chunk: int
    prefix_len: int
    append: tuple[int, int]
    output: tuple[int, int]
    turns: int
    mooncake_requests: int | None
    """Trace requests replayed per level (None: as many as the window takes, up to the trace's end)."""
    mooncake_scale: int
    max_model_len: int
    chunk: int
    window_s: float | None
    """Measurement window per (backend, level); None: run a fixed set of sessions to the end."""
    warmup_s: float | None


def sizes_for(args: argparse.Namespace) -> Sizes:
    if args.device == "cuda" and not args.quick:
        window = args.window_s if args.window_s is not None else GPU_WINDOW_S
        return Sizes("m3-proxy", args.session_len or 1 << 20, 256, 16384, 60_000, (1000, 4000),
                     (100, 500), 3, args.mooncake_requests, 1, 200_000, 8192, window or None, 6.0)
    if args.device == "cuda":  # quick GPU check
        window = args.window_s if args.window_s is not None else GPU_QUICK_WINDOW_S
        return Sizes("m3-proxy", args.session_len or 65_536, 32, 8192, 8000, (500, 1000), (20, 50), 2,
                     args.mooncake_requests, 4, 60_000, 4096, window or None, 3.0)
    # CPU: the tiny preset on a fixed set of sessions run to the end unless --window-s is given.
    scale = 4 if args.quick else 1
    return Sizes("tiny", args.session_len or 2048 // scale, 16 // scale, 256, 600 // scale,
                 (10, 40), (2, 8 // scale), 2, args.mooncake_requests or 16 // scale, 64, 4096, 128,
                 args.window_s or None, None)


def build_engine(args: argparse.Namespace, sizes: Sizes, backend: str, max_model_len: int,
                 max_num_seqs: int, chunk: int, exact_pages: bool = False, decode_steps: int = 1
                 ) -> LLMEngine:
    """exact_pages: a pool of exactly what max_num_seqs × max_model_len needs (no planning from
    free HBM, hence no profiling forward pass, which at 1M dense tokens would take minutes)."""
    overrides = {"num_layers": args.layers} if sizes.preset == "m3-proxy" else {}
    page_size = 128 if sizes.preset == "m3-proxy" else 16
    needed = max_num_seqs * -(-max_model_len // page_size) + 2
    config = EngineConfig(
        model=sizes.preset, model_overrides=overrides, device=args.device,
        dtype="bfloat16" if args.device == "cuda" else "float32", attention_backend=backend,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=chunk, max_model_len=max_model_len,
        max_waiting=10_000, cuda_graphs=args.device == "cuda", decode_steps=decode_steps,
        num_pages=None if args.device == "cuda" and not exact_pages else needed,
    )
    return LLMEngine(config)


def prompt_vocab(engine: LLMEngine) -> int:
    """Token ids below this are plain text: the vocabulary less the media placeholder ids, which a
    prompt may hold only with media (the tiny preset has them)."""
    config = engine.model.config
    placeholders = [getattr(config, name, None) for name in ("image_token_id", "video_token_id")]
    return min([config.vocab_size, *(i for i in placeholders if i is not None)])


def free_memory() -> None:
    """Give back the memory of engines the caller has dropped every reference to."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
