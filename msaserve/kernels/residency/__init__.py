"""One layer's admission step of sparse-KV residency on the device (policy: `engine/kv/residency.py`):
the selection becomes resident in the tables, the misses come back as (dst_slots, src_pages) for
`kernels.page_gather`. No host sync. Triton on CUDA (one launch), the reference of tensor ops elsewhere.

Tables of one layer (each with one spare entry at the end that masked writes go to):
slot_of [max_pages + 1] int32 (page → slot, -1: not resident), page_in [num_slots + 1] int64
(slot → page, -1: free), last_used [num_slots + 1] int64 (the step its page was last selected),
counters [3] int64 (pages fetched, pages evicted, steps that fetched).
"""

import torch

from msaserve.kernels.residency.naive import admit_naive


def admit(selected: torch.Tensor, slot_of: torch.Tensor, page_in: torch.Tensor, last_used: torch.Tensor,
          counters: torch.Tensor, step: int | torch.Tensor, ring: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One working set: tables as above, selected [.., Hkv, K] block ids (-1 unused) → (dst_slots [M]
    int64, -1: no copy; src_pages [M]). R working sets at once (independent, e.g. one per KV head
    of a layer): every table with a leading row dimension ([R, max_pages + 1], ..., counters
    [R, 3]) and selected [R, M] → dst_slots, src_pages [R, M]; on CUDA one launch of R programs.
    step: the step number, or a one-element int64 tensor on the device holding it (read there, so a
    captured CUDA graph replays with the step of its replay)."""
    if selected.device.type == "cuda":
        from msaserve.kernels.residency.triton import admit_triton

        return admit_triton(selected, slot_of, page_in, last_used, counters, step, ring)
    return admit_naive(selected, slot_of, page_in, last_used, counters, step, ring)


__all__ = ["admit", "admit_naive"]
