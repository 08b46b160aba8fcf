"""`triton`: the MSA GPU kernels (CUDA only); the dense (full-attention) layers run the dense
backend's CUDA ops (`dense/gpu.py`: the fastest measured prefill kernel, the paged decode kernel),
so a decode step with full-attention layers stays capturable in a CUDA graph (SDPA's paged decode
read every sequence's offsets on the host, which invalidated the capture)."""

import torch

from msaserve.kernels.dispatch import AttentionOps, load_op, msa_ops


def resolve(device: torch.device) -> AttentionOps:
    if device.type != "cuda":
        raise ValueError(
            f"attention_backend='triton' needs a CUDA device, got {device.type!r}; "
            "use 'naive' or 'msa' on CPU"
        )
    dense = (load_op("gpu", "dense", "dense_prefill"), load_op("gpu", "dense", "dense_decode"))
    return msa_ops("triton", "triton", dense, graph_capturable=True)
