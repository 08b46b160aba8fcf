"""The compiled Triton MSA kernels against the naive spec on a CUDA GPU, at real sizes (M3 shape:
Hkv=4, G=16, D=DI=128, P=128, K=16), plus CUDA-graph capture of the decode step."""

import dataclasses
import functools
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "kernels"))  # tile_dense

from kernel_inputs import make_paged_inputs
from test_kernels_triton_cases import (
    Ops,
    Shape,
    check_indexer_decode,
    check_indexer_prefill,
    check_sparse_decode,
    check_sparse_prefill,
)
from tile_dense import sparse_prefill_tile_dense

from msaserve.kernels import triton_common
from msaserve.kernels.dispatch import get_ops
from msaserve.kernels.indexer_decode import triton as indexer_decode_triton
from msaserve.kernels.sparse_prefill import triton as sparse_prefill_triton


def _ops(backend: str) -> Ops:
    ops = get_ops(backend, "cuda")
    return Ops(ops.indexer_decode, ops.indexer_prefill, ops.sparse_decode, ops.sparse_prefill)


TRITON, NAIVE = _ops("triton"), _ops("naive")
BF16 = torch.bfloat16
# Mixed lengths: below K·P, not multiples of P, and long enough for many splits.
LENS = (300, 2048, 5000, 20011)


def _m3(page_size: int = 128, index_heads: int = 1, group: int = 16, lens: tuple = LENS, n_init: int = 1,
        n_local: int = 1):
    return Shape(lens, page_size=page_size, num_kv_heads=4, group=group, head_dim=128,
                 index_heads=index_heads, top_k=16, n_init=n_init, n_local=n_local)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("num_q", [1, 16])
@pytest.mark.parametrize(("page_size", "index_heads"), [(128, 1), (64, 4)])
def test_indexer_decode(page_size: int, index_heads: int, num_q: int, fp8: bool) -> None:
    check_indexer_decode(TRITON, NAIVE, _m3(page_size, index_heads), num_q, BF16, "cuda", fp8=fp8,
                         seed=num_q + page_size)


@pytest.mark.parametrize("fp8_scan", indexer_decode_triton.FP8_SCANS)
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("num_q", [1, 16])
@pytest.mark.parametrize(("page_size", "index_heads"), [(128, 1), (64, 4)])
def test_indexer_decode_fp8_scans(page_size: int, index_heads: int, num_q: int, dtype: torch.dtype,
                                  fp8_scan: str) -> None:
    """Both fp8 scans, whichever is the default (keys widened to fp16, or as stored against the
    query's fp8 terms); autotuning compiles and runs every config, the chosen one is checked."""
    ops = dataclasses.replace(TRITON, indexer_decode=functools.partial(indexer_decode_triton.indexer_decode,
                                                                       fp8_scan=fp8_scan))
    check_indexer_decode(ops, NAIVE, _m3(page_size, index_heads), num_q, dtype, "cuda", fp8=True,
                         seed=num_q + page_size + 1)


@pytest.mark.parametrize("key_load", indexer_decode_triton.KEY_LOADS)
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("num_q", [1, 16])
@pytest.mark.parametrize(("page_size", "index_heads"), [(128, 1), (64, 4)])
def test_indexer_decode_key_loads(page_size: int, index_heads: int, num_q: int, fp8: bool,
                                  key_load: str) -> None:
    """Pointer gathers and TMA page copies, whichever is the default, with every config autotuning tries."""
    ops = dataclasses.replace(TRITON, indexer_decode=functools.partial(indexer_decode_triton.indexer_decode,
                                                                       key_load=key_load))
    check_indexer_decode(ops, NAIVE, _m3(page_size, index_heads), num_q, BF16, "cuda", fp8=fp8,
                         seed=num_q + page_size + 2)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize(("page_size", "index_heads", "n_init"), [(128, 1, 1), (64, 4, 2), (128, 4, 0)])
def test_indexer_prefill(page_size: int, index_heads: int, n_init: int, fp8: bool) -> None:
    shape = _m3(page_size, index_heads, lens=(300, 2048, 5000, 9001), n_init=n_init)
    check_indexer_prefill(TRITON, NAIVE, shape, BF16, "cuda", fp8=fp8, seed=page_size + n_init)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("n_local", [1, 2])
def test_indexers_m3_form(n_local: int, fp8: bool) -> None:
    """MiniMax-M3's selection: no init block, n_local forced blocks ending at the query's block, one
    index-K head, bf16 or fp8 keys, prefill and decode (1 and 16 queries per sequence)."""
    shape = _m3(lens=(300, 2048, 5000, 9001), n_init=0, n_local=n_local)
    check_indexer_prefill(TRITON, NAIVE, shape, BF16, "cuda", fp8=fp8, seed=10 + n_local)
    for num_q in (1, 16):
        check_indexer_decode(TRITON, NAIVE, shape, num_q, BF16, "cuda", fp8=fp8, seed=num_q + n_local)


@pytest.mark.parametrize("key_load", indexer_decode_triton.KEY_LOADS)
@pytest.mark.parametrize("fp8_scan", indexer_decode_triton.FP8_SCANS)
def test_indexer_decode_m3_form_scans_and_key_loads(fp8_scan: str, key_load: str) -> None:
    """The M3 form (n_init 0, two local blocks) through both fp8 scans and both key loads."""
    scan = functools.partial(indexer_decode_triton.indexer_decode, fp8_scan=fp8_scan, key_load=key_load)
    ops = dataclasses.replace(TRITON, indexer_decode=scan)
    check_indexer_decode(ops, NAIVE, _m3(n_init=0, n_local=2), 4, BF16, "cuda", fp8=True, seed=21)


@pytest.mark.parametrize("num_q", [1, 16])
@pytest.mark.parametrize("group", [1, 4, 6, 8, 16])
def test_sparse_decode(group: int, num_q: int) -> None:
    check_sparse_decode(TRITON, NAIVE, _m3(group=group), num_q, BF16, "cuda", seed=group)


@pytest.mark.parametrize("page_size", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 6, 8, 16])
def test_sparse_prefill(group: int, page_size: int) -> None:
    shape = _m3(page_size, group=group, lens=(300, 2048, 5000, 9001))
    check_sparse_prefill(TRITON, NAIVE, shape, BF16, "cuda", seed=group + page_size)


@pytest.mark.parametrize("group", [1, 4, 6, 8, 16])
def test_sparse_prefill_tile_dense(group: int) -> None:
    """The tile-dense experiment (benchmarks/kernels/tile_dense.py): common blocks of each tile
    computed tile-dense, the rest KV-block-major."""
    ops = dataclasses.replace(TRITON, sparse_prefill=lambda *args: sparse_prefill_tile_dense(*args, 0.5))
    shape = _m3(group=group, lens=(300, 2048, 5000, 9001))
    check_sparse_prefill(ops, NAIVE, shape, BF16, "cuda", seed=group + 3)
    check_sparse_prefill(ops, NAIVE, shape, BF16, "cuda", seed=group + 4, empty_slots=True)


@pytest.mark.parametrize(("n_init", "n_local"), [(1, 1), (0, 2)])
def test_decode_step_replays_in_a_cuda_graph(n_init: int, n_local: int) -> None:
    """Constant grids: a captured indexer + sparse decode step gives the eager result on new data."""
    inputs = make_paged_inputs(list(LENS), 128, 4, 128, 1, 128, BF16, "cuda")
    batch = len(LENS)
    q = torch.randn(batch, 1, 64, 128, device="cuda", dtype=BF16)
    q_index = torch.randn(batch, 1, 4, 128, device="cuda", dtype=BF16)

    def step() -> torch.Tensor:
        selected = TRITON.indexer_decode(q_index, inputs.index_cache, inputs.block_tables,
                                         inputs.seq_lens, 16, n_init, n_local=n_local)
        return TRITON.sparse_decode(q, inputs.k_cache, inputs.v_cache, inputs.block_tables,
                                    inputs.seq_lens, selected)

    step()  # compile and autotune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_out = step()
    q.copy_(torch.randn_like(q))
    q_index.copy_(torch.randn_like(q_index))
    inputs.seq_lens.copy_(inputs.seq_lens - 7)  # shorter sequences, same grid
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured_out.float(), step().float(), atol=1e-3, rtol=1e-3)


def test_sparse_prefill_with_empty_slots() -> None:
    """Emptied slots, and rows with no selected block at all (they come out as zeros)."""
    check_sparse_prefill(TRITON, NAIVE, _m3(lens=(300, 2048, 5000)), BF16, "cuda", seed=5, empty_slots=True)


@pytest.mark.parametrize("tile_dense_share", [None, 0.5])
def test_sparse_prefill_32k_chunk_equals_two_16k_chunks(tile_dense_share: float | None) -> None:
    """A 32K-token chunk at the M3 shape has 2^32 partial elements: offsets must be 64-bit (in the
    tile-dense kernel too: every tile of this selection shares all its blocks)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens, page_size, hkv, group, dim, top_k = 32768, 128, 4, 16, 128, 16
    pages = tokens // page_size
    sparse_prefill = sparse_prefill_triton.sparse_prefill
    if tile_dense_share is not None:  # the experiment (benchmarks/kernels/tile_dense.py)
        sparse_prefill = functools.partial(_tile_dense_with_share, share=tile_dense_share)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16)

    q, k_cache, v_cache = rand(tokens, hkv * group, dim), rand(pages, page_size, hkv, dim), rand(
        pages, page_size, hkv, dim)
    table = torch.randperm(pages, device="cuda", generator=gen).to(torch.int32)[None]
    positions = torch.arange(tokens, device="cuda")
    local = (positions // page_size)[:, None, None]
    # the local block and the 15 blocks below it (clamped at 0, -1 where that would repeat)
    selected = (local - torch.arange(top_k, device="cuda")[None, None, :]).expand(-1, hkv, -1)
    selected = torch.where(selected >= 0, selected, -1).to(torch.int32).contiguous()
    whole = sparse_prefill(q, k_cache, v_cache, table, torch.tensor([tokens], device="cuda"),
                               torch.tensor([0, tokens], device="cuda"), selected)
    half = tokens // 2
    parts = [
        sparse_prefill(q[a:b], k_cache, v_cache, table, torch.tensor([b], device="cuda"),
                           torch.tensor([0, b - a], device="cuda"), selected[a:b])
        for a, b in ((0, half), (half, tokens))
    ]
    torch.testing.assert_close(whole, torch.cat(parts), atol=0, rtol=0)


def test_bulk_lse_merge_equals_the_fixed_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill chunk's merge (≥ TUNED_MERGE_MIN_ROWS rows, autotuned tile) gives the fixed launch's
    result on the same partials, some of them invalid."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    rows, parts, group, dim, heads = triton_common.TUNED_MERGE_MIN_ROWS, 16, 16, 128, 4
    part_o = torch.randn(rows, parts, group, dim, device="cuda", dtype=BF16, generator=gen)
    part_lse = 4 * torch.randn(rows, parts, group, device="cuda", generator=gen)
    valid = torch.randint(-1, 64, (rows, parts), device="cuda", dtype=torch.int32, generator=gen)
    valid[:, 0] = 0  # every row has a partial
    tuned = torch.full((rows // heads, heads * group, dim), float("nan"), device="cuda", dtype=BF16)
    triton_common.lse_merge(part_o, part_lse, valid, tuned)
    monkeypatch.setattr(triton_common, "TUNED_MERGE_MIN_ROWS", 1 << 62)
    fixed = torch.full_like(tuned, float("nan"))
    triton_common.lse_merge(part_o, part_lse, valid, fixed)
    torch.testing.assert_close(tuned, fixed, rtol=1e-2, atol=1e-2)


def _tile_dense_with_share(*args, share: float) -> torch.Tensor:
    return sparse_prefill_tile_dense(*args[:7], share, *args[7:])
