"""Mixture-of-experts ops: `naive.py` is the PyTorch spec (routing and the clamped-SwiGLU experts
of MiniMax-M3); a fast grouped path lives beside it (`grouped.py`) and is tested against it."""

from msaserve.kernels.moe.naive import experts, route

__all__ = ["experts", "route"]
