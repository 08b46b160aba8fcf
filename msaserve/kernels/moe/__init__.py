"""Mixture-of-experts ops: `naive.py` is the PyTorch spec (routing and the clamped-SwiGLU experts
of MiniMax-M3, a loop over the experts hit); `grouped.py` is the fast path with the same signatures
(fused routing, sort by expert on the device, grouped GEMMs, weighted un-permute; no loop over
experts, no host sync, CUDA-graph capturable), its elementwise kernels in `triton.py`. It is tested
against the spec."""

from msaserve.kernels.moe.naive import experts, route

__all__ = ["experts", "route"]
