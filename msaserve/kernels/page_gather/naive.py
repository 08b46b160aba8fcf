"""The reference of `gather_pages`: boolean masking (a host sync on CUDA; none matters on CPU)."""

import torch


def gather_pages_naive(dst: torch.Tensor, dst_slots: torch.Tensor, src: torch.Tensor,
                       src_pages: torch.Tensor) -> None:
    take = dst_slots >= 0
    dst[dst_slots[take].to(dst.device)] = src[src_pages[take].to(src.device)].to(dst.device)
