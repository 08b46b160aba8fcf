"""Rotary position embedding in the HF "rotate_half" layout (first half × second half)."""

import torch


def rotary_cos_sin(
    positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int64 → cos, sin [T, 1, dim] in `dtype`, computed in fp32 as HF does.

    No cached table: the model holds no buffers, so it can be built on the meta device and
    loaded with `assign=True`; the [T, dim/2] outer product is negligible next to attention.
    """
    exponents = torch.arange(0, dim, 2, device=positions.device, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (theta**exponents)  # [dim/2]
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, dim/2]
    angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, dim]; cos, sin [T, 1, dim] → x rotated at each token's position."""
    return x * cos + rotate_half(x) * sin
