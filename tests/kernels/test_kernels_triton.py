"""The Triton MSA kernels against the naive spec under TRITON_INTERPRET=1, on the CPU, at small shapes.

The interpreter is chosen when a kernel is decorated, so the kernel modules are (re)imported here
with TRITON_INTERPRET=1; the variable is set only while this module's tests run. With CUDA
present the compiled kernels are tested by tests/gpu instead, and this module is skipped.
"""

import importlib

import pytest
import torch
import triton

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu tests the compiled kernels", allow_module_level=True)

from test_kernels_triton_cases import (
    Ops,
    Shape,
    check_indexer_decode,
    check_indexer_prefill,
    check_sparse_decode,
    check_sparse_prefill,
)

from msaserve.kernels.testing import import_interpreted

_TRITON_MODULES = [
    "msaserve.kernels.triton_common",
    "msaserve.kernels.indexer_decode.triton",
    "msaserve.kernels.indexer_prefill.triton",
    "msaserve.kernels.sparse_decode.triton",
    "msaserve.kernels.sparse_prefill.triton",
]


_, _idec, _ipre, _sdec, _spre = import_interpreted(*_TRITON_MODULES)
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


@pytest.mark.parametrize("num_q", [1, 16])
@pytest.mark.parametrize("shape", INDEXER_SHAPES, ids=lambda s: f"P{s.page_size}-HkI{s.index_heads}")
def test_indexer_decode_matches_naive(shape: Shape, num_q: int) -> None:
    lens = tuple(max(n, num_q) for n in shape.seq_lens)
    shape = Shape(lens, *[getattr(shape, f) for f in ("page_size", "num_kv_heads", "group", "head_dim",
                                                      "index_heads", "top_k", "n_init")])
    check_indexer_decode(TRITON, NAIVE, shape, num_q, torch.float32, "cpu", seed=num_q)


@pytest.mark.parametrize("shape", INDEXER_SHAPES, ids=lambda s: f"P{s.page_size}-HkI{s.index_heads}")
def test_indexer_prefill_matches_naive(shape: Shape) -> None:
    check_indexer_prefill(TRITON, NAIVE, shape, torch.float32, "cpu", seed=3)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_indexers_with_fp8_index_keys(kind: str) -> None:
    shape = INDEXER_SHAPES[0]
    if kind == "decode":
        check_indexer_decode(TRITON, NAIVE, shape, 2, torch.float32, "cpu", fp8=True, seed=5)
    else:
        check_indexer_prefill(TRITON, NAIVE, shape, torch.float32, "cpu", fp8=True, seed=5)


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
