"""`naive`: the MSA reference ops (PyTorch, any device), and the reference dense ops beside them."""

import torch

from msaserve.kernels.dispatch import AttentionOps, load_op, msa_ops


def resolve(device: torch.device) -> AttentionOps:
    dense = (load_op("naive", "dense", "dense_prefill"), load_op("naive", "dense", "dense_decode"))
    return msa_ops("naive", "naive", dense, graph_capturable=False)
