"""`msa` (the default): the MSA kernels for the device — Triton on CUDA; elsewhere the CPU ops
(`<op>/cpu.py`: the vectorised indexer and the sparse C kernel, equal to the reference) with SDPA
for dense layers."""

import torch

from msaserve.kernels.backends import triton
from msaserve.kernels.dispatch import AttentionOps, load_op, msa_ops


def resolve(device: torch.device) -> AttentionOps:
    if device.type == "cuda":
        return triton.resolve(device)
    dense = (load_op("sdpa", "dense", "dense_prefill"), load_op("sdpa", "dense", "dense_decode"))
    return msa_ops("msa", "cpu", dense, graph_capturable=False)
