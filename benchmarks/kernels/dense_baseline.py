"""The best dense attention at one shape, for the kernel benchmarks: every candidate of
msaserve/kernels/dense (SDPA cuDNN / flash / efficient / SDPA's own choice, FlexAttention,
flash-attn-4 when installed) timed on the same inputs, plus, for decode, the paged flash-decoding
kernel reading the same K/V from a paged cache. Outputs are checked against the first candidate
(relative L2 error, msaserve/kernels/dense/select.py); the fastest that agrees is the baseline.
"""

import math
from collections.abc import Callable

import torch

from msaserve.kernels.dense import paged_decode
from msaserve.kernels.dense.candidates import CANDIDATES
from msaserve.kernels.dense.select import Choice, DenseSelector, Timer, cuda_event_timer, key_for

PAGED = "paged_triton"
ALL_NAMES = [*CANDIDATES, PAGED]
# Candidates whose calls are captured in a CUDA graph for timing small (decode) shapes, as the MSA
# decode step is: their time then holds no host launch gaps. flex and fa4 are timed eagerly
# (events around the call): a compiled or DSL-launched call is not known to be capturable.
GRAPH_CAPTURED = {"sdpa_default", "sdpa_default_gqa", "sdpa_cudnn", "sdpa_cudnn_gqa", "sdpa_flash",
                  "sdpa_efficient", "cudnn_split", "flash_split", PAGED}
# Candidates compiled per shape (minutes over a grid of shapes): left out where many shapes are timed.
COMPILED_PER_SHAPE = {"flex", "fa4"}
NOT_COMPILED = set(ALL_NAMES) - COMPILED_PER_SHAPE


def graph_timer(reps: int = 20) -> Timer:
    """Graph-replay timing for GRAPH_CAPTURED candidates, event timing for the others."""
    from msa_baselines import time_graph_ms

    events = cuda_event_timer(5)
    return lambda name, fn: time_graph_ms(fn, reps=reps) if name in GRAPH_CAPTURED else events(name, fn)


def candidate_row(case: str, choice: Choice, **extra: object) -> dict:
    """One row of the benchmark's `dense_candidates` table: every candidate's ms (nan: did not run)."""
    row = {"case": case, "winner": choice.winner, "best_ms": choice.times_ms[choice.winner], **extra}
    row.update({f"{name}_ms": choice.times_ms.get(name, float("nan")) for name in ALL_NAMES})
    return row


def contiguous_inputs(batch: int, q_heads: int, kv_heads: int, q_len: int, kv_len: int, head_dim: int,
                      dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random q [B, Hq, Tq, D], k/v [B, Hkv, T, D] on CUDA (never zeros: see METHOD.md)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape_kv = (batch, kv_heads, kv_len, head_dim)
    return {"q": torch.randn(batch, q_heads, q_len, head_dim, device="cuda", dtype=dtype, generator=gen),
            "k": torch.randn(shape_kv, device="cuda", dtype=dtype, generator=gen),
            "v": torch.randn(shape_kv, device="cuda", dtype=dtype, generator=gen)}


def to_pages(t: torch.Tensor, page_size: int = 128) -> torch.Tensor:
    """[B, Hkv, T, D] → [B·T/P, P, Hkv, D] (a copy): sequence b's pages are b·T/P .. (b+1)·T/P - 1."""
    batch, kv_heads, kv_len, head_dim = t.shape
    pages = kv_len // page_size
    return t.view(batch, kv_heads, pages, page_size, head_dim).permute(0, 2, 3, 1, 4).reshape(
        batch * pages, page_size, kv_heads, head_dim)


def paged_call(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
               seq_lens: torch.Tensor, scale: float):
    """The paged decode kernel as a zero-argument call: q [B, Hq, Tq, D] in SDPA's layout → o in
    that layout, the K/V read from the paged cache."""
    q_paged = q.transpose(1, 2).contiguous()  # [B, Tq, Hq, D]
    args = (q_paged, k_cache, v_cache, tables, seq_lens, scale)
    return lambda: paged_decode.dense_decode(*args).transpose(1, 2)


def paged_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, page_size: int = 128):
    """paged_call over the same K/V laid out as pages (copied once here, outside the timed call)."""
    batch, _, kv_len, _ = k.shape
    pages = kv_len // page_size
    tables = torch.arange(batch * pages, device=k.device, dtype=torch.int32).view(batch, pages)
    seq_lens = torch.full((batch,), kv_len, device=k.device, dtype=torch.int32)
    return paged_call(q, to_pages(k, page_size), to_pages(v, page_size), tables, seq_lens, scale)


def best_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, paged: bool | Callable = False,
               only: set[str] | None = None, reps: int = 5, timer: Timer | None = None) -> Choice:
    """Time every applicable candidate (those named in `only`, if given) on these inputs; with
    paged=True (decode shapes; T a multiple of 128) the paged kernel too, over page copies of k/v
    (or `paged` itself as that call, over caches the caller holds). → the Choice (winner, times_ms
    per candidate, errors for those that refused or disagreed)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    selector = DenseSelector(timer=timer or cuda_event_timer(reps))
    runs = {name: fn for name, fn in selector.runs(q, k, v, scale).items() if only is None or name in only}
    if paged and (only is None or PAGED in only):
        runs[PAGED] = paged if callable(paged) else paged_run(q, k, v, scale)
    choice = selector.choose_among(key_for(q, k), runs)
    runs.clear()
    torch.cuda.empty_cache()
    return choice


def attention_flops(batch: int, q_heads: int, q_len: int, kv_len: int, head_dim: int) -> float:
    """QKᵀ and PV over the visible keys (lower-right causal): query i sees T - Tq + i + 1 keys."""
    keys = q_len * (kv_len - q_len) + q_len * (q_len + 1) / 2
    return 4.0 * batch * q_heads * head_dim * keys


def kv_bytes(batch: int, kv_heads: int, kv_len: int, head_dim: int, elem: int = 2) -> float:
    """K and V read once."""
    return 2.0 * batch * kv_heads * kv_len * head_dim * elem
