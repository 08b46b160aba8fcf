"""`dense`: dense causal attention, the baseline. On CUDA every prefill and decode call runs the
fastest dense kernel measured for its shape and mask kind (`dense/gpu.py`, `dense/select.py`: SDPA's
backends, FlexAttention, flash-attn-4 when installed, the paged flash-decoding kernel; a captured
decode step is always the paged kernel); elsewhere SDPA. The index branch is skipped
(`sparse=False`), so the MSA ops are never called; they are the reference ones."""

import torch

from msaserve.kernels.dispatch import AttentionOps, load_op


def resolve(device: torch.device) -> AttentionOps:
    impl = "gpu" if device.type == "cuda" else "sdpa"
    ops = ("indexer_prefill", "indexer_decode", "sparse_prefill", "sparse_decode")
    msa = {op: load_op("naive", op) for op in ops}
    return AttentionOps(
        name="dense", sparse=False, **msa,
        dense_prefill=load_op(impl, "dense", "dense_prefill"),
        dense_decode=load_op(impl, "dense", "dense_decode"),
        graph_capturable=device.type == "cuda",
    )
