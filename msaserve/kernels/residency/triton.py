"""The admission as one Triton program (`naive.py` is the reference: same slots, same tables).

The victim order is a `tl.sort` of the selection slots' composite keys, written to a scratch row so
that the r-th miss can load the r-th slot; barriers order the program's own table writes and reads.
"""

import torch
import triton
import triton.language as tl

from msaserve.kernels.residency.naive import FREE, USED_NOW, check_rows


@triton.jit
def _admit_kernel(selected, slot_of, page_in, last_used, counters, dst_out, src_out, scratch,
                  step_ptr, ring, num_slots, max_pages, M, sel_row, slot_row, page_row, used_row, count_row,
                  MP: tl.constexpr, GP: tl.constexpr, FREE_KEY: tl.constexpr, USED_KEY: tl.constexpr):
    """Program r admits working set r (its row of every table)."""
    r = tl.program_id(0).to(tl.int64)
    selected += r * sel_row
    slot_of += r * slot_row
    page_in += r * page_row
    last_used += r * used_row
    counters += r * count_row
    dst_out += r * M
    src_out += r * M
    scratch += r * GP
    step = tl.load(step_ptr)
    offs = tl.arange(0, MP)
    pages = tl.load(selected + offs, mask=offs < M, other=-1).to(tl.int64)
    valid = pages >= 0
    pages = tl.maximum(pages, 0)
    same = (pages[:, None] == pages[None, :]) & valid[None, :] & (offs[None, :] < offs[:, None])
    first = valid & (tl.max(same.to(tl.int32), axis=1) == 0)
    slots = tl.load(slot_of + pages, mask=first, other=-1).to(tl.int64)
    hit = first & (slots >= 0)
    miss = first & (slots < 0)
    tl.store(last_used + slots, step, mask=hit)
    tl.debug_barrier()
    # Victim order over the selection slots [ring, num_slots).
    g = ring + tl.arange(0, GP)
    in_range = g < num_slots
    used = tl.load(last_used + g, mask=in_range, other=0)
    held = tl.load(page_in + g, mask=in_range, other=0)
    width = tl.full([GP], 1, tl.int64) * (num_slots + 1)  # int64: keys reach USED_KEY · num_slots
    key = tl.where(held < 0, tl.full([GP], FREE_KEY, tl.int64), used)
    key = tl.where(used == step, tl.full([GP], USED_KEY, tl.int64), key)
    composite = (key - FREE_KEY) * width + g
    composite = tl.where(in_range, composite, tl.full([GP], USED_KEY, tl.int64) * width * 2)
    order = tl.sort(composite) % width
    tl.store(scratch + tl.arange(0, GP), order)
    tl.debug_barrier()
    rank = tl.cumsum(miss.to(tl.int32), axis=0) - 1
    victim = tl.load(scratch + tl.maximum(rank, 0), mask=miss, other=0)
    old = tl.load(page_in + victim, mask=miss, other=-1)
    evicted = miss & (old >= 0)
    tl.store(slot_of + old, -1, mask=evicted)
    tl.debug_barrier()
    tl.store(page_in + victim, pages, mask=miss)
    tl.store(last_used + victim, step, mask=miss)
    tl.store(slot_of + pages, victim.to(tl.int32), mask=miss)
    tl.store(dst_out + offs, tl.where(miss, victim, -1), mask=offs < M)
    tl.store(src_out + offs, pages, mask=offs < M)
    n_miss = tl.sum(miss.to(tl.int64), axis=0)
    tl.store(counters, tl.load(counters) + n_miss)
    tl.store(counters + 1, tl.load(counters + 1) + tl.sum(evicted.to(tl.int64), axis=0))
    tl.store(counters + 2, tl.load(counters + 2) + (n_miss > 0).to(tl.int64))


def admit_triton(selected: torch.Tensor, slot_of: torch.Tensor, page_in: torch.Tensor,
                 last_used: torch.Tensor, counters: torch.Tensor, step: int | torch.Tensor,
                 ring: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One working set (1-D tables, selected [.., K]) or R (2-D tables, selected [R, M]): R programs."""
    batched = slot_of.dim() == 2
    if batched:
        rows = check_rows(selected, slot_of, page_in, last_used, counters)
        flat = selected.contiguous()
    else:
        rows, flat = 1, selected.reshape(1, -1).contiguous()
    for name, t, dtype in (("slot_of", slot_of, torch.int32), ("page_in", page_in, torch.int64),
                           ("last_used", last_used, torch.int64), ("counters", counters, torch.int64)):
        if t.dtype != dtype or t.stride(-1) != 1:
            raise ValueError(f"{name} is {t.dtype} with strides {t.stride()}: allowed {dtype} with "
                             "contiguous rows")
    if isinstance(step, torch.Tensor):
        if step.dtype != torch.int64 or step.numel() != 1 or step.device != flat.device:
            raise ValueError(f"step is {step.dtype} {tuple(step.shape)} on {step.device}: allowed an int or "
                             f"one int64 element on {flat.device}")
        step_ptr = step
    else:
        step_ptr = torch.full((1,), step, dtype=torch.int64, device=flat.device)
    m, num_slots = flat.shape[1], page_in.shape[-1] - 1
    gp = triton.next_power_of_2(max(num_slots - ring, 1))
    dst = torch.empty(rows, m, dtype=torch.int64, device=flat.device)
    src = torch.empty(rows, m, dtype=torch.int64, device=flat.device)
    scratch = torch.empty(rows, gp, dtype=torch.int64, device=flat.device)

    def row(t: torch.Tensor) -> int:
        return t.stride(0) if batched else 0

    _admit_kernel[(rows,)](flat, slot_of, page_in, last_used, counters, dst, src, scratch, step_ptr, ring,
                           num_slots, slot_of.shape[-1] - 1, m, flat.stride(0), row(slot_of), row(page_in),
                           row(last_used), row(counters), MP=triton.next_power_of_2(m), GP=gp,
                           FREE_KEY=FREE, USED_KEY=USED_NOW, num_warps=8 if gp >= 2048 else 4)
    return (dst, src) if batched else (dst[0], src[0])
