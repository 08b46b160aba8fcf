"""`msa` (the default): the MSA kernels for the device — Triton on CUDA, the reference elsewhere."""

import torch

from msaserve.kernels.backends import naive, triton
from msaserve.kernels.dispatch import AttentionOps


def resolve(device: torch.device) -> AttentionOps:
    return triton.resolve(device) if device.type == "cuda" else naive.resolve(device)
