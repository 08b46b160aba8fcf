"""The decode ops' small merges under TRITON_INTERPRET=1 on the CPU: the decode indexer's split merge
(msaserve/kernels/indexer_decode/merge.py: serial, packed and tree launches) and the LSE merge of
partial attention outputs (msaserve/kernels/triton_common.py: the serial and the all-parts launch).

The split merge is checked exactly against a PyTorch statement of the selection rule (value desc,
then id asc; empty slots and -inf never chosen), on candidates full of ties, for several split
counts (powers of two and not), and end to end through `indexer_decode` against the naive op. With
CUDA present tests/gpu covers the compiled kernels and this module is skipped.
"""

import dataclasses
import functools
import importlib

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu tests the compiled kernels", allow_module_level=True)

from decode_merge_cases import EMPTY, candidates, lse_merge_formula, partials, selection_rule
from kernel_testing import import_interpreted
from test_kernels_triton_cases import Ops, Shape, check_indexer_decode, check_sparse_decode

_common, _merge, _idec, _sdec = import_interpreted(
    "msaserve.kernels.triton_common", "msaserve.kernels.indexer_decode.merge",
    "msaserve.kernels.indexer_decode.triton", "msaserve.kernels.sparse_decode.triton",
)
NAIVE = Ops(
    importlib.import_module("msaserve.kernels.indexer_decode.naive").indexer_decode, None,
    importlib.import_module("msaserve.kernels.sparse_decode.naive").sparse_decode, None,
)
METHODS = ("serial", "packed", "tree")


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize(("splits", "num_q", "top_k"), [(1, 1, 16), (5, 8, 16), (16, 1, 5), (17, 2, 16),
                                                        (33, 1, 16), (70, 8, 4)])
def test_split_merges_follow_the_selection_rule(splits: int, num_q: int, top_k: int) -> None:
    """Every launch gives exactly the rule's selection, ties included, over 1–70 splits, Q = 1 to 8
    (row padding), top_k below its power of two, batch 2, both key-head layouts."""
    hpk, key_heads = (4, 1) if splits % 2 else (2, 2)
    kp = 1 << (top_k - 1).bit_length()
    vals, ids = candidates(2, key_heads, splits, num_q * hpk, kp, seed=splits)
    want = selection_rule(vals, ids, num_q, hpk, top_k)
    for method in METHODS:
        out = torch.full_like(want, 7)
        _merge.merge_splits(vals, ids, out, hpk, method)
        assert torch.equal(out, want), f"{method}: {(out != want).nonzero()[:4].tolist()}"


def test_tree_groups() -> None:
    """Level-1 groups of ~√splits splits; the tests' empty id is the kernels'."""
    assert _common.EMPTY_ID_BASE.value == EMPTY
    for splits, size in ((1, 1), (2, 2), (9, 4), (16, 4), (17, 8), (33, 8), (264, 32)):
        assert _merge._group_size(splits) == size
    with pytest.raises(ValueError, match="split_merge is 'heap'; allowed serial, packed, tree, auto"):
        _merge.merge_splits(*candidates(1, 1, 2, 4, 4, 0), torch.empty(1, 1, 4, 4, dtype=torch.int32), 4,
                            "heap")


_M3_LIKE = Shape((150, 700, 1100), page_size=16, num_kv_heads=4, group=1, head_dim=32, index_heads=1,
                 top_k=16, n_init=0, n_local=2)


@pytest.mark.parametrize(("num_splits", "num_q", "index", "method"),
                         [(3, 1, "fp32", "auto"), (17, 8, "fp8", "auto"), (24, 1, "fp8", "tree"),
                          (12, 8, "bf16", "packed"), (20, 1, "bf16", "serial")])
def test_indexer_decode_split_counts_match_naive(num_splits: int, num_q: int, index: str,
                                                 method: str) -> None:
    """The whole op with forced split counts (more splits than the short sequences have pages: empty
    splits), fp32, bf16 and fp8 index keys (bf16 queries with fp8), batch 3, Q 1 and 8: the naive op's
    selection up to near-ties. The merges' exact agreement with each other is the test above."""
    op = functools.partial(_idec.indexer_decode, split_merge=method, num_splits=num_splits)
    dtype = torch.float32 if index == "fp32" else torch.bfloat16
    check_indexer_decode(dataclasses.replace(NAIVE, indexer_decode=op), NAIVE, _M3_LIKE, num_q, dtype, "cpu",
                         fp8=index == "fp8", seed=num_splits)


@pytest.mark.parametrize(("rows", "parts", "group", "dim", "heads_per_row"),
                         [(4, 16, 16, 32, 4), (6, 3, 6, 64, 2), (5, 1, 1, 16, 1), (3, 40, 4, 32, 3),
                          (2, 128, 2, 32, 1), (2, 257, 1, 16, 2)])
@pytest.mark.parametrize("with_valid", [False, True])
def test_lse_merges_agree(rows: int, parts: int, group: int, dim: int, heads_per_row: int,
                          with_valid: bool) -> None:
    """The serial and all-parts launches against the merge's formula: parts 1 to 257 (a power of two
    and not; 257 past the all-parts limit, so "auto" is serial there), G 1 to 16, several heads
    groups per output row, skipped parts and empty (-inf) ones, fp32 and bf16 partials."""
    for dtype in (torch.float32, torch.bfloat16) if parts <= 128 else (torch.float32,):  # interpreter time
        part_o, part_lse, valid = partials(rows, parts, group, dim, dtype, seed=rows * parts)
        valid = valid if with_valid else None
        want = lse_merge_formula(part_o.float(), part_lse, valid, heads_per_row)
        for method in ("serial", "parts", "auto"):
            out = torch.full((rows // heads_per_row, heads_per_row * group, dim), float("nan"))
            _common.lse_merge(part_o, part_lse, valid, out, method)
            torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5,
                                       msg=lambda m, d=dtype, k=method: f"{k} {d}: {m}")


@pytest.mark.parametrize(("num_splits", "num_q", "dtype"), [(3, 1, torch.float32), (5, 8, torch.bfloat16),
                                                            (16, 1, torch.bfloat16)])
def test_sparse_decode_split_counts_match_naive(num_splits: int, num_q: int, dtype: torch.dtype) -> None:
    """Sparse decode with forced split counts (non-powers of two leave splits with fewer or no slots)
    merged by each launch: the naive op's output."""
    shape = Shape((150, 83), page_size=16, num_kv_heads=2, group=4, head_dim=32, index_heads=1, top_k=16)
    for method in ("serial", "parts"):
        op = functools.partial(_sdec.sparse_decode, merge=method, num_splits=num_splits)
        check_sparse_decode(dataclasses.replace(NAIVE, sparse_decode=op), NAIVE, shape, num_q, dtype, "cpu",
                            seed=num_splits)
