"""Lower-right causal attention as two mask-free-or-square calls merged by their log-sum-exp.

Tq queries at the end of T keys see (a) every one of the first T - Tq keys, and (b) the last Tq
keys causally (a square: upper-left and lower-right causal agree). So a backend with no
lower-right mask (cuDNN through PyTorch) still computes a prefill chunk: (a) with no mask and (b)
with is_causal, each returning its output and LSE, merged exactly:
    o = (o_a·e^{lse_a} + o_b·e^{lse_b}) / (e^{lse_a} + e^{lse_b}).
Part (a) has no mask, so the query axis may hold anything: the G query heads of a KV head are
folded into it ([B, Hkv, G·Tq, D] against the KV heads as stored), reading each KV head once and
needing no GQA support; this also makes a few decode queries per sequence (multi-token
prediction, Tq = 8) one pass over the KV instead of one per query.
"""

from collections.abc import Callable

import torch

# (q, k, v, scale, causal) → (o [B, H, Tq, D], lse [B, H, Tq] natural log, fp32)
Tensor = torch.Tensor
AttendLse = Callable[[Tensor, Tensor, Tensor, float, bool], tuple[Tensor, Tensor]]


class SplitUnsupported(RuntimeError):
    """The backend refused a part, or the shape is not a chunk (candidates.py re-raises it as its
    Unsupported)."""


def _cudnn_lse(q, k, v, scale, causal):
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                             scale=scale)
    return out[0], out[1].reshape(q.shape[:3]).float()


def _flash_lse(q, k, v, scale, causal):
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out[0], out[1].reshape(q.shape[:3]).float()


def math_lse(q, k, v, scale, causal):
    """Reference (any device, any dtype): the same contract in plain PyTorch, fp32."""
    logits = q.float() @ k.float().transpose(-1, -2) * scale
    if causal:
        q_len, kv_len = q.shape[2], k.shape[2]
        rows = torch.arange(q_len, device=q.device)[:, None]
        visible = torch.arange(kv_len, device=q.device)[None, :] <= rows
        logits = logits.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(logits, -1)
    return (torch.softmax(logits, -1) @ v.float()).to(q.dtype), lse


BACKENDS: dict[str, AttendLse] = {"cudnn": _cudnn_lse, "flash": _flash_lse, "math": math_lse}


def merge(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Two attention outputs over disjoint key sets → the output over their union (o_a's dtype)."""
    top = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - top)[..., None], torch.exp(lse_b - top)[..., None]
    return ((o_a.float() * w_a + o_b.float() * w_b) / (w_a + w_b)).to(o_a.dtype)


def split_attention(attend: AttendLse, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q [B, Hq, Tq, D], k/v [B, Hkv, T, D] (1 < Tq < T) → lower-right causal GQA o [B, Hq, Tq, D]."""
    batch, q_heads, q_len, head_dim = q.shape
    kv_heads, prefix = k.shape[1], k.shape[2] - q_len
    group = q_heads // kv_heads
    folded = q.reshape(batch, kv_heads, group * q_len, head_dim)  # a view: q is contiguous
    o_a, lse_a = attend(folded, k[:, :, :prefix], v[:, :, :prefix], scale, False)
    k_b = k[:, :, prefix:].repeat_interleave(group, dim=1)  # the last Tq keys only: a small copy
    v_b = v[:, :, prefix:].repeat_interleave(group, dim=1)
    o_b, lse_b = attend(q, k_b, v_b, scale, True)
    return merge(o_a.reshape(q.shape), lse_a.reshape(q.shape[:3]), o_b, lse_b)


def split_lower_right(backend: str) -> Callable[[Tensor, Tensor, Tensor, float], Tensor]:
    """A dense candidate (candidates.py) computing chunks through `backend`'s LSE-returning op."""
    attend = BACKENDS[backend]

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        if not 1 < q.shape[2] < k.shape[2]:
            raise SplitUnsupported(f"split attention computes 1 < Tq < T, got Tq={q.shape[2]}, "
                                   f"T={k.shape[2]}")
        if backend != "math" and not q.is_cuda:
            raise SplitUnsupported(f"{backend} needs CUDA")
        try:
            return split_attention(attend, q.contiguous(), k, v, scale)
        except RuntimeError as exc:
            raise SplitUnsupported(f"{backend} split: {exc}") from exc

    return run
