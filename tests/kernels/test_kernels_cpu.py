"""The CPU MSA ops (`<op>/cpu.py`, the `msa` backend's on CPU) against the naive spec: the C kernels
(fp32) and the vectorised PyTorch paths they fall back to (MSASERVE_CPU_NATIVE=0, and other
dtypes), on random paged inputs with scattered pages, chunked prefill, decode with several
queries, shuffled and empty selection slots, shared or per-head index keys, and the M3 form."""

import importlib

import pytest
import torch
from test_kernels_triton_cases import (
    Ops,
    Shape,
    check_indexer_decode,
    check_indexer_prefill,
    check_sparse_decode,
    check_sparse_prefill,
)

from msaserve.kernels import cpu_native
from msaserve.kernels.dispatch import get_ops


def _ops(impl: str) -> Ops:
    return Ops(*(importlib.import_module(f"msaserve.kernels.{op}.{impl}").__dict__[op] for op in
                 ("indexer_decode", "indexer_prefill", "sparse_decode", "sparse_prefill")))


CPU, NAIVE = _ops("cpu"), _ops("naive")
_LENS = (9, 48, 83, 150, 301)
SHAPES = [
    Shape(_LENS, page_size=16, num_kv_heads=2, group=3, head_dim=32, index_heads=1, top_k=4),
    Shape(_LENS, page_size=16, num_kv_heads=2, group=2, head_dim=32, index_heads=2, top_k=4, n_init=2),
    # MSA in the M3 form: no init block, n_local forced blocks ending at the query's block.
    Shape(_LENS, page_size=16, num_kv_heads=2, group=1, head_dim=32, index_heads=1, top_k=4, n_init=0,
          n_local=2),
    Shape((40, 300, 129), page_size=32, num_kv_heads=3, group=3, head_dim=64, index_heads=1, top_k=5,
          n_init=0, n_local=3),
    # P and D multiples of 64: the C kernels' 4 x 64 register tiles (SmolLM2's converted shape).
    Shape((40, 300, 129), page_size=64, num_kv_heads=3, group=3, head_dim=64, index_heads=3, top_k=3),
]
IDS = [f"P{s.page_size}-G{s.group}-HkI{s.index_heads}-init{s.n_init}-local{s.n_local}" for s in SHAPES]


@pytest.fixture(params=["native", "torch"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test runs on the C kernels and on the PyTorch fallback."""
    if request.param == "torch":
        monkeypatch.setenv("MSASERVE_CPU_NATIVE", "0")
    else:
        from msaserve.kernels.sparse_prefill import cpu_kernel

        if cpu_kernel.library() is None:
            pytest.skip("no C compiler here: only the PyTorch path runs")
    return request.param


def test_msa_backend_uses_the_cpu_ops_on_cpu() -> None:
    ops = get_ops("msa", "cpu")
    assert ops.sparse and ops.sparse_prefill is CPU.sparse_prefill
    assert ops.indexer_prefill is CPU.indexer_prefill and ops.indexer_decode is CPU.indexer_decode


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_indexers_match_naive(shape: Shape, path: str) -> None:
    check_indexer_prefill(CPU, NAIVE, shape, torch.float32, "cpu", seed=1)
    check_indexer_decode(CPU, NAIVE, shape, 3, torch.float32, "cpu", seed=2)


def test_indexers_with_fp8_index_keys(path: str) -> None:
    check_indexer_prefill(CPU, NAIVE, SHAPES[0], torch.float32, "cpu", fp8=True, seed=3)
    check_indexer_decode(CPU, NAIVE, SHAPES[2], 1, torch.float32, "cpu", fp8=True, seed=4)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_sparse_ops_match_naive(shape: Shape, path: str) -> None:
    check_sparse_prefill(CPU, NAIVE, shape, torch.float32, "cpu", seed=5)
    check_sparse_decode(CPU, NAIVE, shape, 1, torch.float32, "cpu", seed=6)
    check_sparse_decode(CPU, NAIVE, shape, 4, torch.float32, "cpu", seed=7)


def test_sparse_prefill_with_empty_slots(path: str) -> None:
    check_sparse_prefill(CPU, NAIVE, SHAPES[0], torch.float32, "cpu", seed=8, empty_slots=True)


def test_sparse_ops_bf16_take_the_torch_path() -> None:
    check_sparse_prefill(CPU, NAIVE, SHAPES[3], torch.bfloat16, "cpu", seed=9)
    check_sparse_decode(CPU, NAIVE, SHAPES[1], 2, torch.bfloat16, "cpu", seed=10)


def test_native_build_is_cached_by_source(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A source builds once into the cache directory; a changed source is a new library."""
    monkeypatch.setenv("MSASERVE_CACHE_DIR", str(tmp_path))
    source = "int answer(void) { return 42; }\n"
    lib = cpu_native.load("probe", source)
    if lib is None:
        pytest.skip("no C compiler here")
    assert lib.answer() == 42
    assert len(list(tmp_path.glob("probe-*.so"))) == 1
    assert cpu_native.load("probe", source.replace("42", "7")).answer() == 7
    assert len(list(tmp_path.glob("probe-*.so"))) == 2


def test_loading_a_native_kernel_keeps_subnormal_floats(tmp_path) -> None:
    """Linking with -ffast-math added crtfastmath.o, whose constructor turned on flush-to-zero for the
    whole process the moment the library loaded: afterwards every float op in the server (and
    hypothesis in the test suite) lost subnormals. Checked in a fresh process: the mode is global."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "from msaserve.kernels import cpu_native\n"
        "lib = cpu_native.load('subnormal_probe', 'float half(float x) { return x * 0.5f; }\\n')\n"
        "if lib is None:\n"
        "    print('no-compiler'); sys.exit(0)\n"
        "tiny = sys.float_info.min\n"
        "print('ok' if tiny / 2 > 0 else 'flushed')\n"
    )
    env = {**__import__("os").environ, "MSASERVE_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                         timeout=120, check=True).stdout.strip()
    if out == "no-compiler":
        pytest.skip("no C compiler here")
    assert out == "ok"


def test_c_block_selection_refuses_a_top_k_its_stack_arrays_cannot_hold() -> None:
    """msa_select_blocks keeps its candidates in fixed stack arrays: a larger top_k is an error naming
    the value and the range, never a write past them."""
    from msaserve.kernels.indexer_prefill import cpu_kernel

    if cpu_kernel.library() is None:
        pytest.skip("no C compiler here")
    scores = torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match=r"top_k=4097 .* allowed 1 to 4096"):
        cpu_kernel.select_blocks(scores, 0, 64, cpu_kernel.MAX_TOP_K + 1, 1, 1)
    assert cpu_kernel.select_blocks(scores, 0, 64, 4, 1, 1).shape == (3, 2, 4)
