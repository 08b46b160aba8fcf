"""Sizes, model and engines of the offline serving benchmark (`offline.py`), shared by its parts.

The model is `m3-mini` (MiniMax-M3's text model at its real widths, `--layers` layers, random
weights; `msaserve/models/presets.py`), built once per process and shared by every engine: the
MSA and dense engines differ only in the attention backend they run (the dense one runs every
layer as full attention through the fastest dense kernel, `msaserve/kernels/dense/`). On the CPU
the same preset runs at `M3_MINI_SMALL`'s widths, to check the scripts end to end.
"""

import argparse
import gc
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from msaserve.engine.config import EngineConfig
from msaserve.engine.llm_engine import LLMEngine
from msaserve.models.loader import LoadedModel, load_model
from msaserve.models.presets import M3_MINI_DENSE_MLP_LAYERS, M3_MINI_SMALL

PRESET = "m3-mini"
# Measurement window per (backend, level) of the traffic parts, in seconds. On the GPU the traffic
# parts make 2 backends × (3 agentic + 1 Mooncake) levels = 8 windows: 8 × 15 s plus two engine
# builds and warm-ups fit one 7-minute run beside the 128K prefill and the step breakdown.
GPU_WINDOW_S = 15.0
GPU_QUICK_WINDOW_S = 6.0


@dataclass
class Sizes:
    """Workload sizes: the GPU ones from the issue, or scaled down for the CPU."""

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
    prefill_len: int
    """The long-prefill part's prompt (128K on the GPU)."""
    preset: str = PRESET


def sizes_for(args: argparse.Namespace) -> Sizes:
    if args.device == "cuda" and not args.quick:
        window = args.window_s if args.window_s is not None else GPU_WINDOW_S
        return Sizes(args.session_len or 1 << 20, 256, 16384, 60_000, (1000, 4000), (100, 500), 3,
                     args.mooncake_requests, 1, 200_000, 8192, window or None, 5.0, 1 << 17)
    if args.device == "cuda":  # quick GPU check: real widths, short sequences
        window = args.window_s if args.window_s is not None else GPU_QUICK_WINDOW_S
        return Sizes(args.session_len or 32_768, 16, 8192, 8000, (500, 1000), (20, 50), 2,
                     args.mooncake_requests, 4, 40_000, 4096, window or None, 2.0, 16_384)
    # CPU: small widths on a fixed set of sessions run to the end unless --window-s is given.
    scale = 4 if args.quick else 1
    return Sizes(args.session_len or 2048 // scale, 16 // scale, 256, 600 // scale, (10, 40), (2, 8 // scale),
                 2, args.mooncake_requests or 16 // scale, 64, 4096, 128, args.window_s or None, None,
                 1024 // scale)


def model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """config.json overrides of m3-mini: the layer count, and on the CPU the small widths."""
    small = M3_MINI_SMALL if args.device == "cpu" else {}
    return {**small, "num_hidden_layers": args.layers}


def model_label(args: argparse.Namespace) -> str:
    """How every figure names its model."""
    moe = args.layers - M3_MINI_DENSE_MLP_LAYERS
    widths = " at small CPU widths" if args.device == "cpu" else ""
    return (f"{PRESET}{widths}, {args.layers} layers ({M3_MINI_DENSE_MLP_LAYERS} dense MLP + {moe} MoE), "
            "random weights")


_MODELS: dict[tuple, LoadedModel] = {}


def shared_model(args: argparse.Namespace) -> LoadedModel:
    """The one m3-mini of this process (weights drawn once: ≈ 50 GB at 4 layers)."""
    key = (args.device, args.layers)
    if key not in _MODELS:
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        _MODELS[key] = load_model(PRESET, device=args.device, dtype=dtype, attention_backend="msa",
                                  progress=False, seed=0, **model_overrides(args))
    return _MODELS[key]


class SelectorWatch:
    """`with SelectorWatch(label) as watch:` around a timed part; `watch.count` is the dense keys the
    selector measured inside it (0 for a valid figure), and any count is warned about on stderr."""

    def __init__(self, label: str):
        self.label, self.count = label, 0

    def __enter__(self) -> "SelectorWatch":
        from msaserve.kernels.dense.select import default_selector

        self.before = default_selector().measurements
        return self

    def __exit__(self, *exc_info) -> None:
        from msaserve.kernels.dense.select import default_selector

        self.count = default_selector().measurements - self.before
        if self.count:
            print(f"WARNING {self.label}: the dense selector measured {self.count} keys inside the timed "
                  "part: this figure is not valid", file=sys.stderr, flush=True)


def pretune_dense(config, device: str, chunk: int, max_model_len: int, whole_chunks: bool) -> None:
    """Measure the dense selector's prefill keys (chunks of 2 tokens up to `chunk`, over every
    KV bucket up to max_model_len) before any timed part: measured inside a timed prefill they
    had cost the dense side several seconds (each new KV bucket times every candidate), which
    inflated MSA's prefill ratios. Once per process (the selector caches its choices). whole_chunks:
    one long prompt in chunks of `chunk` (the session and prefill parts) — only that chunk size."""
    from msaserve.kernels.dense.select import default_selector

    # Traffic: every power-of-two chunk bucket from 2 tokens up (a Mooncake turn's last chunk can be a
    # few hundred tokens: pretuning from 1K up left two keys to be measured inside the timed window).
    powers = [1 << i for i in range(1, chunk.bit_length()) if 1 << i < chunk]
    q_lens = [chunk] if whole_chunks else [*powers, chunk]
    start = time.perf_counter()
    measured = default_selector().pretune(config.num_heads, config.num_kv_heads, config.head_dim,
                                          torch.bfloat16 if device == "cuda" else torch.float32,
                                          device, q_lens, max_model_len)
    if measured:
        print(f"dense selector: {measured} prefill keys measured in {time.perf_counter() - start:.1f} s "
              "(before any timed part)", file=sys.stderr, flush=True)


def build_engine(args: argparse.Namespace, sizes: Sizes, backend: str, max_model_len: int,
                 max_num_seqs: int, chunk: int, exact_pages: bool = False, decode_steps: int = 1
                 ) -> LLMEngine:
    """An engine over the shared model running `backend`. exact_pages: a pool of exactly what
    max_num_seqs × max_model_len needs (no planning from free HBM, hence no profiling forward
    pass, which at 1M dense tokens would take minutes)."""
    loaded = shared_model(args)
    page_size = loaded.config.page_size
    needed = max_num_seqs * -(-max_model_len // page_size) + 2
    config = EngineConfig(
        model=PRESET, model_overrides=model_overrides(args), device=args.device,
        dtype="bfloat16" if args.device == "cuda" else "float32", attention_backend=backend,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=chunk, max_model_len=max_model_len,
        max_waiting=10_000, cuda_graphs=args.device == "cuda", decode_steps=decode_steps,
        num_pages=None if args.device == "cuda" and not exact_pages else needed,
    )
    loaded.model.attention_backend = backend  # the runner resolves its ops from the model's backend
    if backend == "dense":
        pretune_dense(loaded.config, args.device, chunk, max_model_len, whole_chunks=exact_pages)
    engine = LLMEngine(config, model=loaded.model, tokenizer=loaded.tokenizer)
    graphs = "on" if engine.runner.graphs is not None else "off"
    print(f"{backend} engine: {engine.runner.num_pages} pages of {page_size}, decode CUDA graphs {graphs}",
          file=sys.stderr, flush=True)
    return engine


def prompt_vocab(engine: LLMEngine) -> int:
    """Token ids below this are plain text: the vocabulary less the media placeholder ids, which a
    prompt may hold only with media."""
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
