"""The Triton MSA kernels against the naive spec under TRITON_INTERPRET=1, on the CPU, at small shapes.

The interpreter is chosen when a kernel is decorated, so the kernel modules are (re)imported here
with TRITON_INTERPRET=1; the variable is set only while this module's tests run. With CUDA
present the compiled kernels are tested by tests/gpu instead, and this module is skipped.
"""

import dataclasses
import functools
import importlib

import pytest
import torch
import triton
import triton.language as tl

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu tests the compiled kernels", allow_module_level=True)

from kernel_testing import import_interpreted
from test_kernels_triton_cases import (
    Ops,
    Shape,
    check_indexer_decode,
    check_indexer_prefill,
    check_sparse_decode,
    check_sparse_prefill,
)

_TRITON_MODULES = [
    "msaserve.kernels.triton_common",
    "msaserve.kernels.indexer_decode.merge",
    "msaserve.kernels.indexer_decode.triton",
    "msaserve.kernels.indexer_prefill.query_groups",
    "msaserve.kernels.indexer_prefill.triton",
    "msaserve.kernels.sparse_decode.triton",
    "msaserve.kernels.sparse_prefill.triton",
]


_, _, _idec, _groups, _ipre, _sdec, _spre = import_interpreted(*_TRITON_MODULES)
TRITON = Ops(_idec.indexer_decode, _ipre.indexer_prefill, _sdec.sparse_decode, _spre.sparse_prefill)
NAIVE = Ops(
    importlib.import_module("msaserve.kernels.indexer_decode.naive").indexer_decode,
    importlib.import_module("msaserve.kernels.indexer_prefill.naive").indexer_prefill,
    importlib.import_module("msaserve.kernels.sparse_decode.naive").sparse_decode,
    importlib.import_module("msaserve.kernels.sparse_prefill.naive").sparse_prefill,
)


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# Mixed lengths: below K·P, a multiple of P, and several pages past K·P with a partial last page.
_LENS_16 = (9, 48, 83, 150)

INDEXER_SHAPES = [
    Shape(_LENS_16, page_size=16, num_kv_heads=2, group=1, head_dim=32, index_heads=1, top_k=4),
    Shape(_LENS_16, page_size=16, num_kv_heads=2, group=1, head_dim=32, index_heads=2, top_k=4, n_init=2),
    Shape((40, 300, 129), page_size=64, num_kv_heads=3, group=1, head_dim=32, index_heads=1, top_k=3,
          n_init=0),
]
# MSA in the M3 form: no init block, n_local forced blocks ending at the query's block, one index-K head.
M3_SHAPES = [
    Shape(_LENS_16, page_size=16, num_kv_heads=2, group=1, head_dim=32, index_heads=1, top_k=4, n_init=0),
    Shape(_LENS_16, page_size=16, num_kv_heads=2, group=1, head_dim=32, index_heads=1, top_k=4, n_init=0,
          n_local=2),
    Shape((40, 300, 129), page_size=32, num_kv_heads=4, group=1, head_dim=32, index_heads=1, top_k=5,
          n_init=1, n_local=3),
]


def _shape_id(shape: Shape) -> str:
    return f"P{shape.page_size}-HkI{shape.index_heads}-init{shape.n_init}-local{shape.n_local}"



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_query_split_into_fp8_terms(dtype: torch.dtype) -> None:
    """q = s · (t0 + t1/16 + t2/256) with fp8 terms: exact for bf16 (two terms) and fp16 (three)
    wherever the terms stay in e4m3's normal range (elements above 2⁻¹² of their row's max), within
    2⁻¹¹ of each element for fp32; zero rows stay zero."""

    @triton.jit
    def split_kernel(q_ptr, terms_ptr, scale_ptr, NR: tl.constexpr, DI: tl.constexpr, TERMS: tl.constexpr):
        offs = tl.arange(0, NR)[:, None] * DI + tl.arange(0, DI)[None, :]
        t0, t1, t2, scale = _idec._split_query(tl.load(q_ptr + offs), TERMS)
        tl.store(terms_ptr + offs, t0)
        tl.store(terms_ptr + NR * DI + offs, t1)
        tl.store(terms_ptr + 2 * NR * DI + offs, t2)
        tl.store(scale_ptr + tl.arange(0, NR), scale)

    gen = torch.Generator().manual_seed(4)
    q = torch.randn(16, 64, generator=gen) * torch.exp2(torch.randint(-8, 9, (16, 1), generator=gen).float())
    q[3] = 0.0
    q = q.to(dtype)
    terms = torch.empty(3, 16, 64, dtype=torch.float8_e4m3fn)
    scale = torch.empty(16)
    num_terms = _idec._QUERY_TERMS[dtype]
    split_kernel[(1,)](q, terms, scale, NR=16, DI=64, TERMS=num_terms)
    t = terms.double()
    assert scale.log2().frac().eq(0).all(), "scales must be powers of two"
    rebuilt = scale.double()[:, None] * (t[0] + t[1] / 16 + t[2] / 256)
    want = q.double()
    row_max = want.abs().amax(1, keepdim=True)
    err = (rebuilt - want).abs()
    assert rebuilt[3].eq(0).all()
    if num_terms == 2:
        assert t[2].eq(0).all()
    if dtype == torch.float32:
        worst = (err / want.abs()).nan_to_num().max()
        assert (err <= want.abs() * 2.0**-11).all(), f"max relative error {worst}"
    else:
        normal = want.abs() >= row_max * 2.0**-12
        assert err[normal].eq(0).all(), f"{dtype}: max error {err[normal].max()} where it must be exact"
        assert (err <= row_max * 2.0**-16).all()


@pytest.mark.parametrize("fp8_scan", _idec.FP8_SCANS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_decode_fp8_scans(dtype: torch.dtype, fp8_scan: str) -> None:
    """Both fp8 scans, whichever is the default: keys widened to fp16, or scanned as stored against
    the query's fp8 terms (three for fp32, two for bf16)."""
    ops = dataclasses.replace(TRITON, indexer_decode=functools.partial(_idec.indexer_decode,
                                                                       fp8_scan=fp8_scan))
    for shape, seed in ((INDEXER_SHAPES[0], 5), (INDEXER_SHAPES[1], 6), (M3_SHAPES[1], 9)):
        for num_q in (1, 16):
            lens = tuple(max(n, num_q) for n in shape.seq_lens)
            check_indexer_decode(ops, NAIVE, dataclasses.replace(shape, seq_lens=lens), num_q, dtype, "cpu",
                                 fp8=True, seed=seed + num_q)


@pytest.mark.parametrize("key_load", _idec.KEY_LOADS)
@pytest.mark.parametrize("fp8", [False, True])
def test_indexer_decode_key_loads(fp8: bool, key_load: str) -> None:
    """Both ways a key page reaches the MMA, whichever is the default: pointer gathers, or one TMA
    box per page (a [pages·P, HkI·DI] descriptor; both HkI = 1 and HkI = Hkv views)."""
    scan = functools.partial(_idec.indexer_decode, key_load=key_load)
    ops = dataclasses.replace(TRITON, indexer_decode=scan)
    for shape, seed in ((INDEXER_SHAPES[0], 7), (INDEXER_SHAPES[1], 8), (M3_SHAPES[1], 10)):
        lens = tuple(max(n, 2) for n in shape.seq_lens)
        check_indexer_decode(ops, NAIVE, dataclasses.replace(shape, seq_lens=lens), 2, torch.float32, "cpu",
                             fp8=fp8, seed=seed)


@pytest.mark.parametrize("num_q", [1, 16])
@pytest.mark.parametrize("shape", INDEXER_SHAPES + M3_SHAPES, ids=_shape_id)
def test_indexer_decode_matches_naive(shape: Shape, num_q: int) -> None:
    shape = dataclasses.replace(shape, seq_lens=tuple(max(n, num_q) for n in shape.seq_lens))
    check_indexer_decode(TRITON, NAIVE, shape, num_q, torch.float32, "cpu", seed=num_q)


@pytest.mark.parametrize("shape", INDEXER_SHAPES + M3_SHAPES, ids=_shape_id)
def test_indexer_prefill_matches_naive(shape: Shape) -> None:
    check_indexer_prefill(TRITON, NAIVE, shape, torch.float32, "cpu", seed=3)


@pytest.mark.parametrize(("gate", "block_rows"), [(False, None), (True, 64)])
@pytest.mark.parametrize("shape", [INDEXER_SHAPES[0], M3_SHAPES[1]], ids=_shape_id)
def test_indexer_prefill_tile_forms_match_naive(shape: Shape, gate: bool, block_rows: int | None) -> None:
    """The insertion gate (skip a page's top-K insertion when no row's score beats its worst entry)
    and the tile's row count change no selection: each form against the spec, on the same inputs."""
    def form(q, cache, tables, seq_lens, cu, top_k, n_init=1, index_scale=None, n_local=1):
        return _ipre._launch(q, cache, index_scale, tables, seq_lens, cu, top_k, n_init, n_local, gate=gate,
                             block_rows=block_rows)

    ops = dataclasses.replace(TRITON, indexer_prefill=form)
    check_indexer_prefill(ops, NAIVE, shape, torch.float32, "cpu", seed=3)


GROUPS = dataclasses.replace(TRITON, indexer_prefill=functools.partial(_ipre.indexer_prefill, path="groups"))


@pytest.mark.parametrize("shape", [INDEXER_SHAPES[0], INDEXER_SHAPES[1], M3_SHAPES[1]], ids=_shape_id)
def test_indexer_prefill_by_query_groups_matches_naive(shape: Shape) -> None:
    """The short-chunk path (the decode kernels over groups of 16 queries): chunks of 1 to 150
    queries per sequence, whole sequences and suffixes, the first group of each partly before the chunk."""
    check_indexer_prefill(GROUPS, NAIVE, shape, torch.float32, "cpu", seed=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_prefill_by_query_groups_with_fp8_and_bf16(dtype: torch.dtype) -> None:
    check_indexer_prefill(GROUPS, NAIVE, M3_SHAPES[1], dtype, "cpu", fp8=dtype == torch.float32, seed=6)


def test_query_group_map_covers_every_query_once() -> None:
    """Chunks of 0, 1, 15, 16, 17 and 40 queries: each query is the real slot of exactly one group,
    at its own position (the group's length − 16 + slot), and groups end at their last query."""
    counts, prefix = [0, 1, 15, 16, 17, 40], [5, 0, 100, 3, 0, 7]
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([c + p for c, p in zip(counts, prefix, strict=True)], dtype=torch.int32)
    token, real, seq, length = _groups.group_map(cu, seq_lens, int(cu[-1]))
    assert token.shape[0] == -(-int(cu[-1]) // _groups.GROUP) + len(counts)
    assert sorted(token[real].tolist()) == list(range(int(cu[-1])))
    for g, s in enumerate(seq.tolist()):
        for slot in range(_groups.GROUP):
            if real[g, slot]:
                t = int(token[g, slot])
                position = int(seq_lens[s]) - (int(cu[s + 1]) - t)
                assert cu[s] <= t < cu[s + 1] and position == int(length[g]) - _groups.GROUP + slot
        if real[g].any():
            assert real[g, -1]  # a used group ends at a real query


@pytest.mark.parametrize("shape", [INDEXER_SHAPES[0], M3_SHAPES[1]], ids=_shape_id)
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_indexers_with_fp8_index_keys(kind: str, shape: Shape) -> None:
    if kind == "decode":
        check_indexer_decode(TRITON, NAIVE, shape, 2, torch.float32, "cpu", fp8=True, seed=5)
    else:
        check_indexer_prefill(TRITON, NAIVE, shape, torch.float32, "cpu", fp8=True, seed=5)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_indexers_m3_form_with_bf16_inputs(kind: str) -> None:
    """bf16 queries and index keys (M3's dtype), n_init 0 and two local blocks."""
    shape = M3_SHAPES[1]
    if kind == "decode":
        check_indexer_decode(TRITON, NAIVE, shape, 4, torch.bfloat16, "cpu", seed=12)
    else:
        check_indexer_prefill(TRITON, NAIVE, shape, torch.bfloat16, "cpu", seed=12)


@pytest.mark.parametrize(("group", "num_q"), [(1, 1), (4, 1), (6, 1), (8, 1), (16, 1), (4, 16), (16, 16)])
def test_sparse_decode_matches_naive(group: int, num_q: int) -> None:
    lens = (16, 48, 83, 150) if num_q == 1 else (16, 150)
    shape = Shape(lens, page_size=16, num_kv_heads=2, group=group, head_dim=32,
                  index_heads=1, top_k=4)
    check_sparse_decode(TRITON, NAIVE, shape, num_q, torch.float32, "cpu", seed=group)


@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("group", [1, 4, 6, 8, 16])
def test_sparse_prefill_matches_naive(group: int, prefetch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both sub-tile loops (compiler-pipelined and register-prefetched); BLOCK_M = 32 rows so that items
    run several sub-tiles at these sizes."""
    kernel = _spre._block_major_kernel
    monkeypatch.setattr(kernel, "configs", [triton.Config({"BLOCK_M": 32, "PREFETCH": prefetch})])
    monkeypatch.setattr(kernel, "cache", {})
    shape = Shape(_LENS_16, page_size=16, num_kv_heads=2, group=group, head_dim=32, index_heads=1, top_k=4)
    check_sparse_prefill(TRITON, NAIVE, shape, torch.float32, "cpu", seed=group)


def test_sparse_prefill_with_empty_slots() -> None:
    """Emptied slots, and rows with no selected block at all (they come out as zeros)."""
    shape = Shape(_LENS_16, page_size=16, num_kv_heads=2, group=4, head_dim=32, index_heads=1, top_k=4)
    check_sparse_prefill(TRITON, NAIVE, shape, torch.float32, "cpu", seed=11, empty_slots=True)


def test_sparse_ops_bf16_and_page_64() -> None:
    shape = Shape((70, 200), page_size=64, num_kv_heads=2, group=4, head_dim=32, index_heads=1, top_k=3)
    check_sparse_prefill(TRITON, NAIVE, shape, torch.bfloat16, "cpu", seed=7)
    check_sparse_decode(TRITON, NAIVE, shape, 1, torch.bfloat16, "cpu", seed=7)


def test_launchers_reject_bad_shapes() -> None:
    index_cache = torch.randn(4, 16, 3, 32)  # HkI = 3 with Hkv = 2: not allowed
    with pytest.raises(ValueError, match="HkI=3"):
        TRITON.indexer_decode(torch.randn(1, 1, 2, 32), index_cache, torch.zeros(1, 4, dtype=torch.int32),
                              torch.tensor([10], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="1–16 queries"):
        TRITON.indexer_decode(torch.randn(1, 17, 2, 32), index_cache[:, :, :1],
                              torch.zeros(1, 4, dtype=torch.int32), torch.tensor([40], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="key_load is 'dma'; allowed pointer, tma"):
        TRITON.indexer_decode(torch.randn(1, 1, 2, 32), index_cache[:, :, :1],
                              torch.zeros(1, 4, dtype=torch.int32), torch.tensor([5]), 2, key_load="dma")
    with pytest.raises(ValueError, match="fp8_scan is 'fast'; allowed widen-keys, split-query"):
        TRITON.indexer_decode(torch.randn(1, 1, 2, 32), index_cache[:, :, :1],
                              torch.zeros(1, 4, dtype=torch.int32), torch.tensor([40], dtype=torch.int32), 4,
                              fp8_scan="fast")


def test_sparse_ops_take_m3_form_selections() -> None:
    """The sparse kernels read whatever the indexer chose: M3's selections (no init block, two local
    blocks) as well; nothing in them assumes block 0 is present."""
    shape = dataclasses.replace(M3_SHAPES[1], group=4)
    check_sparse_prefill(TRITON, NAIVE, shape, torch.float32, "cpu", seed=13)
    check_sparse_decode(TRITON, NAIVE, shape, 2, torch.float32, "cpu", seed=13)
