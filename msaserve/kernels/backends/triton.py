"""`triton`: the MSA GPU kernels (CUDA only), with SDPA for the dense layers."""

import torch

from msaserve.kernels.dispatch import AttentionOps, load_op, msa_ops


def resolve(device: torch.device) -> AttentionOps:
    if device.type != "cuda":
        raise ValueError(
            f"attention_backend='triton' needs a CUDA device, got {device.type!r}; "
            "use 'naive' or 'msa' on CPU"
        )
    dense = (load_op("sdpa", "dense", "dense_prefill"), load_op("sdpa", "dense", "dense_decode"))
    return msa_ops("triton", "triton", dense, graph_capturable=True)
