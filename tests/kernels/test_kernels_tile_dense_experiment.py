"""The tile-dense sparse-prefill experiment (benchmarks/kernels/tile_dense.py, kept out of the product
because it measured slower on the H200) against the naive spec under TRITON_INTERPRET=1: bench_msa.py
times it, so it must stay correct. It plugs into the product kernel's `prepass` hook."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu tests the compiled kernels", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "kernels"))

from kernel_testing import import_interpreted
from test_kernels_triton import NAIVE, TRITON
from test_kernels_triton_cases import Shape, check_sparse_prefill

# test_kernels_triton imported the product kernels interpreted; the experiment plugs into them.
(_tile_dense,) = import_interpreted("tile_dense")
_LENS_16 = (9, 48, 83, 150)


@pytest.mark.parametrize("share", [0.5, 1.0])
@pytest.mark.parametrize("group", [1, 4, 6, 8, 16])
def test_sparse_prefill_tile_dense_matches_naive(group: int, share: float) -> None:
    """Common blocks of a tile computed tile-dense, the rest KV-block-major, merged: the same output.
    Chunks of mixed lengths put tiles across sequence boundaries; emptied slots leave gaps and
    queries with nothing selected for a head."""
    def tile_dense_op(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, selected):
        args = (q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, selected)
        return _tile_dense.sparse_prefill_tile_dense(*args, share)

    ops = dataclasses.replace(TRITON, sparse_prefill=tile_dense_op)
    shape = Shape(_LENS_16, page_size=16, num_kv_heads=2, group=group, head_dim=32, index_heads=1, top_k=4)
    check_sparse_prefill(ops, NAIVE, shape, torch.float32, "cpu", seed=group)
    check_sparse_prefill(ops, NAIVE, shape, torch.float32, "cpu", seed=group + 11, empty_slots=True)


def _plan_case(share: float) -> tuple:
    """A selection where queries 0–5 share blocks {0, 1, 2}, queries 6–9 choose alone, and a second
    sequence starts at query 10, inside the first tile of 8 (tiles 0: 0–7, 1: 8–15)."""
    sel = torch.full((16, 1, 4), -1, dtype=torch.int32)
    sel[:6, 0, :3] = torch.tensor([0, 1, 2])
    sel[:6, 0, 3] = torch.arange(3, 9)
    sel[6:10, 0, 0] = torch.tensor([9, 10, 11, 12])
    sel[10:, 0, :2] = torch.tensor([0, 1])
    seq = torch.tensor([0] * 10 + [1] * 6)
    return sel, _tile_dense.plan_tiles(sel, seq, max_pages=16, bq=8, min_share=share)


def test_tile_dense_plan_splits_every_choice_exactly_once() -> None:
    sel, (tail, dense_ids, dense_count, dense_slot, merge_valid) = _plan_case(0.5)
    # tile 0: blocks 0, 1, 2 chosen by 6 of 8 queries → common; tile 1 straddles sequences → none.
    assert dense_count.tolist() == [[3], [0]]
    assert sorted(dense_ids[0, 0, :3].tolist()) == [0, 1, 2] and dense_ids[0, 0, 3:].eq(-1).all()
    assert tail[:6, 0, :3].eq(-1).all() and torch.equal(tail[:6, 0, 3], sel[:6, 0, 3])
    assert torch.equal(tail[6:], sel[6:])  # alone, or in the straddling tile
    assert dense_slot[:6, 0].eq(0).all() and dense_slot[6:].eq(-1).all()
    # partials read by the merge: 1 common + 1 own for queries 0–5, the selection elsewhere
    assert (merge_valid[:6] >= 0).sum(-1).eq(2).all()
    assert torch.equal(merge_valid[6:] >= 0, sel[6:] >= 0)


def test_tile_dense_share_out_of_range_is_rejected() -> None:
    cache = torch.randn(4, 16, 2, 32)
    with pytest.raises(ValueError, match=r"tile_dense_share is 1.5; allowed a share in \(0, 1\]"):
        _tile_dense.sparse_prefill_tile_dense(
            torch.randn(8, 4, 32), cache, cache, torch.arange(4, dtype=torch.int32)[None], torch.tensor([40]),
            torch.tensor([0, 8]), torch.zeros(8, 2, 4, dtype=torch.int32), 1.5)


def test_tile_dense_plan_respects_the_share() -> None:
    _, (_, _, dense_count, _, _) = _plan_case(0.8)  # 6 of 8 < 80 %: nothing common
    assert dense_count.eq(0).all()
