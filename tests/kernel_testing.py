"""Helpers shared by the CPU and GPU kernel tests: selection comparison up to near-ties (docs/design.md §2,
property 4), scattered block tables, and importing Triton modules under the interpreter."""

import importlib
import os
import sys
from types import ModuleType

import torch


def import_interpreted(*names: str) -> list[ModuleType]:
    """(Re)import the Triton modules `names` with TRITON_INTERPRET=1, so their kernels run on CPU
    tensors: Triton picks the interpreter when a kernel is decorated, i.e. at import. The variable
    is restored afterwards."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return [importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)
                for name in names]
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def selections_match(
    got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor, tolerance: float
) -> tuple[bool, str]:
    """Compare two selections as sets, allowing near-tie swaps.

    got, want: [N, Hkv, K] block ids (-1 pad, any order); scores: [N, Hkv, num_blocks] fp32.
    A block may differ only if a block of the other selection scores within `tolerance` of it.
    Returns (ok, message describing the first mismatch).
    """
    got_sorted = torch.sort(got, dim=-1).values
    want_sorted = torch.sort(want, dim=-1).values
    differ = (got_sorted != want_sorted).any(dim=-1)  # [N, Hkv]
    for n, h in differ.nonzero().tolist():
        g = {b for b in got[n, h].tolist() if b >= 0}
        w = {b for b in want[n, h].tolist() if b >= 0}
        if len(g) != len(w):
            return False, f"row {n} head {h}: {len(g)} blocks selected, expected {len(w)}"
        extra, missing = sorted(g - w), sorted(w - g)
        swapped = [float(scores[n, h, b]) for b in extra + missing]
        if max(swapped) - min(swapped) > tolerance:
            return False, (
                f"row {n} head {h}: selected {extra} instead of {missing}; their scores "
                f"{swapped} differ by more than the tolerance {tolerance}"
            )
    return True, ""


def scattered_block_tables(
    seq_lens: list[int], page_size: int, num_pages: int, generator: torch.Generator
) -> torch.Tensor:
    """Block tables [B, max_pages] int32 mapping each sequence to random distinct physical pages
    (-1 past its length), so paged kernels are tested on non-contiguous layouts."""
    pages_needed = [(n + page_size - 1) // page_size for n in seq_lens]
    if sum(pages_needed) > num_pages:
        raise ValueError(f"{sum(pages_needed)} pages needed but the pool has {num_pages}")
    perm = torch.randperm(num_pages, generator=generator)
    table = torch.full((len(seq_lens), max(pages_needed)), -1, dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages_needed):
        table[b, :n] = perm[start : start + n].to(torch.int32)
        start += n
    return table
