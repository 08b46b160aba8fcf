"""Every dense attention kernel a user could run at one shape: the candidates `select.py` times.

All take contiguous tensors in SDPA's layout and compute the same function:
q [B, Hq, Tq, D], k/v [B, Hkv, T, D] (Hq a multiple of Hkv, GQA) → o [B, Hq, Tq, D], with the
queries at the last Tq positions of the T keys (lower-right causal): query i sees keys
0 .. T - Tq + i. Tq == T is plain causal attention; Tq == 1 (decode) sees every key.

The mask kind decides which candidates apply (`MASK_KINDS`):
- "causal": Tq == T (a whole prompt prefilled at once);
- "chunk": 1 < Tq < T (a prefill chunk at the end of a long KV, or several decode queries);
- "decode": Tq == 1.

A candidate may refuse a call (its backend does not take the shape, dtype or device): it raises
`Unsupported`, and the selector skips it. Where a backend does not take GQA, the candidate
expands the KV heads first and that copy is part of its time (what a user of it would pay). For
Tq == 1 the group's query heads are folded into the query axis instead ([B, Hkv, G, D] against the
KV heads as stored): with one query per sequence and no mask this is the same attention, and every
backend runs it without a copy.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from msaserve.kernels.dense.split import SplitUnsupported, split_lower_right

MASK_KINDS = ("causal", "chunk", "decode")


class Unsupported(RuntimeError):
    """The candidate cannot run this call (backend, dtype, device or shape)."""


@dataclass(frozen=True)
class Candidate:
    """name: stable id (used in caches and tables); kinds: the mask kinds it computes;
    fn(q, k, v, scale) → o as described in the module docstring; cuda_only: never tried on CPU;
    exact_shape: compiled for each exact shape, so a measurement at one length says nothing about the
    other lengths of its bucket (each new length recompiles, and past torch's recompile limit the call
    silently runs an unfused path that materialises the scores): benchmarks may time it shape by
    shape, the engine's bucketed selector never picks it."""

    name: str
    kinds: frozenset[str]
    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    cuda_only: bool = True
    exact_shape: bool = False


def mask_kind(q_len: int, kv_len: int) -> str:
    """The mask kind of Tq queries at the end of T keys."""
    if q_len < 1 or kv_len < q_len:
        raise ValueError(f"q_len={q_len}, kv_len={kv_len}: allowed 1 ≤ q_len ≤ kv_len")
    if q_len == 1:
        return "decode"
    return "causal" if q_len == kv_len else "chunk"


def expand_kv(k: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """[B, Hkv, T, D] → [B, Hq, T, D], each KV head repeated for its group (a copy)."""
    return k.repeat_interleave(num_q_heads // k.shape[1], dim=1)


def _fold_decode(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, 1, D] → [B, Hkv, G, D]: the group's heads become the query axis."""
    batch, num_q_heads, _, head_dim = q.shape
    return q.reshape(batch, k.shape[1], num_q_heads // k.shape[1], head_dim)


def _sdpa_forced(backend: SDPBackend) -> Callable[..., torch.Tensor]:
    """SDPA with one backend forced; causal (is_causal, GQA as stored where the backend takes it,
    else expanded) or decode (folded, no mask)."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        with sdpa_kernel([backend]):
            try:
                if q.shape[2] == 1:
                    o = F.scaled_dot_product_attention(_fold_decode(q, k), k, v, scale=scale)
                    return o.reshape(q.shape)
                if q.shape[2] != k.shape[2]:
                    raise Unsupported(f"{backend.name} has no lower-right causal mask through SDPA")
                if k.shape[1] == q.shape[1] or _takes_gqa(backend, q, k, v, scale):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                          enable_gqa=k.shape[1] != q.shape[1])
                kx, vx = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
                return F.scaled_dot_product_attention(q, kx, vx, is_causal=True, scale=scale)
            except RuntimeError as exc:  # "No available kernel": the backend refused these inputs
                if isinstance(exc, Unsupported):
                    raise
                raise Unsupported(f"{backend.name}: {exc}") from exc

    return run


_GQA_SUPPORT: dict[tuple, bool] = {}


def _takes_gqa(backend: SDPBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> bool:
    """Whether `backend` (already forced) runs causal GQA as stored, for this dtype and device; asked
    once with a small call, so a backend that refuses costs no failed full-size launch per call."""
    key = (backend, q.dtype, q.device.type, q.shape[-1], q.shape[1] // k.shape[1])
    if key not in _GQA_SUPPORT:
        small_q = q[:1, :, :64].contiguous()
        try:
            F.scaled_dot_product_attention(small_q, k[:1, :, :64].contiguous(), v[:1, :, :64].contiguous(),
                                           is_causal=True, scale=scale, enable_gqa=True)
            _GQA_SUPPORT[key] = True
        except RuntimeError:
            _GQA_SUPPORT[key] = False
    return _GQA_SUPPORT[key]


def _sdpa_default(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Whatever SDPA picks by itself (also the CPU path): GQA native, lower-right through CausalBias."""
    from torch.nn.attention.bias import causal_lower_right

    if q.shape[2] == 1:
        return F.scaled_dot_product_attention(_fold_decode(q, k), k, v, scale=scale).reshape(q.shape)
    if q.shape[2] == k.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    # CausalBias's fused lower-right paths do not take GQA: expand (a copy, counted in its time).
    bias = causal_lower_right(q.shape[2], k.shape[2])
    kx, vx = (expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])) if q.is_cuda else (k, v)
    return F.scaled_dot_product_attention(q, kx, vx, attn_mask=bias, scale=scale, enable_gqa=not q.is_cuda)


def _flash_lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """PyTorch's flash kernel called directly: its is_causal is bottom-right aligned and it reads
    GQA heads as stored. Decode goes through SDPA's flash backend (folded)."""
    if q.shape[2] == 1 or q.shape[2] == k.shape[2]:
        return _sdpa_forced(SDPBackend.FLASH_ATTENTION)(q, k, v, scale)
    if not q.is_cuda:
        raise Unsupported("flash attention needs CUDA")
    try:
        flash = torch.ops.aten._scaled_dot_product_flash_attention
        return flash(q, k, v, 0.0, is_causal=True, scale=scale)[0]
    except RuntimeError as exc:
        raise Unsupported(f"flash (lower-right): {exc}") from exc


def _efficient_lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Memory-efficient attention; lower-right causal through its custom mask type (2)."""
    if q.shape[2] == 1 or q.shape[2] == k.shape[2]:
        return _sdpa_forced(SDPBackend.EFFICIENT_ATTENTION)(q, k, v, scale)
    if not q.is_cuda:
        raise Unsupported("efficient attention needs CUDA")
    kx, vx = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    try:
        out = torch.ops.aten._efficient_attention_forward(
            q.transpose(1, 2), kx.transpose(1, 2), vx.transpose(1, 2), bias=None, cu_seqlens_q=None,
            cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0, custom_mask_type=2,
            compute_log_sumexp=False, scale=scale, seqlen_k=None,
        )[0]
    except RuntimeError as exc:
        raise Unsupported(f"efficient (lower-right): {exc}") from exc
    return out.transpose(1, 2)


@cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@cache
def _flex_block_mask(batch: int, q_len: int, kv_len: int, device: str) -> object:
    """Dense lower-right causal BlockMask (cached: building it scans every block pair)."""
    from torch.nn.attention.flex_attention import create_block_mask

    offset = kv_len - q_len

    def lower_right(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    # _compile: without it the mask is evaluated on the whole [Tq, T] grid at once (128 GiB at 128K).
    return create_block_mask(lower_right, None, None, q_len, kv_len, device=device, _compile=True)


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """FlexAttention (compiled Triton) with a dense causal block mask; GQA native."""
    if not q.is_cuda:
        raise Unsupported("FlexAttention is compiled for CUDA here")
    mask = _flex_block_mask(1, q.shape[2], k.shape[2], str(q.device))
    return _compiled_flex()(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)


@cache
def _fa4_func() -> Callable[..., object] | None:
    try:
        from flash_attn.cute import flash_attn_func
    except Exception:  # not installed, or installed without a usable CUTLASS DSL
        return None
    return flash_attn_func


def fa4_available() -> bool:
    """Whether flash-attn-4 (flash_attn.cute) imports here."""
    return _fa4_func() is not None


def _fa4(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """flash-attn-4 (CuTe DSL; Hopper and Blackwell): [B, T, H, D] layout, causal is bottom-right
    aligned, GQA native."""
    func = _fa4_func()
    if func is None or not q.is_cuda:
        raise Unsupported("flash-attn-4 is not installed (optional; see docs/performance-kernels.md)")
    try:
        out = func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                   causal=q.shape[2] > 1)
    except Exception as exc:  # its DSL compiler raises its own types
        raise Unsupported(f"flash-attn-4: {exc!r}") from exc
    out = out[0] if isinstance(out, tuple) else out
    return out.transpose(1, 2)


def _sdpa_decode_gqa(backend: SDPBackend | None) -> Callable[..., torch.Tensor]:
    """Decode (Tq == 1) with the KV heads as stored through SDPA's enable_gqa, not folded: the
    layout a user of SDPA would write; some backends run it faster than the folded one."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        if q.shape[2] != 1:
            raise Unsupported("decode only")
        try:
            if backend is None:
                return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
        except RuntimeError as exc:
            raise Unsupported(f"{backend}: {exc}") from exc

    return run


def _split(backend: str) -> Callable[..., torch.Tensor]:
    """A chunk as a mask-free part and a square causal part merged by LSE (split.py)."""
    run = split_lower_right(backend)

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        try:
            return run(q, k, v, scale)
        except SplitUnsupported as exc:
            raise Unsupported(str(exc)) from exc

    return call


_ALL = frozenset(MASK_KINDS)
_NO_CHUNK = frozenset({"causal", "decode"})

CANDIDATES: dict[str, Candidate] = {c.name: c for c in (
    Candidate("sdpa_default", _ALL, _sdpa_default, cuda_only=False),
    Candidate("sdpa_default_gqa", frozenset({"decode"}), _sdpa_decode_gqa(None)),
    Candidate("sdpa_cudnn_gqa", frozenset({"decode"}), _sdpa_decode_gqa(SDPBackend.CUDNN_ATTENTION)),
    Candidate("sdpa_cudnn", _NO_CHUNK, _sdpa_forced(SDPBackend.CUDNN_ATTENTION)),
    Candidate("sdpa_flash", _ALL, _flash_lower_right),
    Candidate("sdpa_efficient", _ALL, _efficient_lower_right),
    Candidate("flex", _ALL, _flex, exact_shape=True),
    Candidate("cudnn_split", frozenset({"chunk"}), _split("cudnn")),
    Candidate("flash_split", frozenset({"chunk"}), _split("flash")),
    Candidate("fa4", _ALL, _fa4),
)}


def bucketable() -> dict[str, Candidate]:
    """The candidates whose one measurement serves every length of a shape bucket (the engine's)."""
    return {name: c for name, c in CANDIDATES.items() if not c.exact_shape}


def applicable(kind: str, device: torch.device) -> list[Candidate]:
    """The candidates that compute `kind` and may run on `device` (in CANDIDATES order)."""
    if kind not in MASK_KINDS:
        raise ValueError(f"mask kind {kind!r} is not one of {', '.join(MASK_KINDS)}")
    return [c for c in CANDIDATES.values() if kind in c.kinds and (device.type == "cuda" or not c.cuda_only)]


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
