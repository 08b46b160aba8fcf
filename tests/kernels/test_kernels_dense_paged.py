"""The dense paged decode kernel (msaserve/kernels/dense/paged_decode.py) against the dense reference
(dense/naive.py) under TRITON_INTERPRET=1 on the CPU, at small shapes. With CUDA present the compiled
kernel is tested by tests/gpu/test_gpu_dense_paged.py instead, and this module is skipped."""

import importlib
import itertools
import os
import sys

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu tests the compiled kernel", allow_module_level=True)

from kernel_inputs import PagedInputs, make_paged_inputs

from msaserve.kernels.dense.naive import dense_decode as naive_dense_decode
from msaserve.kernels.dense.naive import dense_prefill as naive_dense_prefill
from msaserve.kernels.dispatch import get_ops

_MODULE = "msaserve.kernels.dense.paged_decode"


def _import_interpreted():
    """The interpreter is chosen when a kernel is decorated: (re)import with TRITON_INTERPRET=1."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        common = importlib.import_module("msaserve.kernels.triton_common")
        if not common.INTERPRET:
            importlib.reload(common)
        return importlib.reload(sys.modules[_MODULE]) if _MODULE in sys.modules else importlib.import_module(
            _MODULE)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


paged = _import_interpreted()
# gpu.py binds the kernel at import: reload it after the kernel module.
gpu_ops = importlib.reload(importlib.import_module("msaserve.kernels.dense.gpu"))

# Below one page, exactly one page, several pages with a partial last one.
LENS = (1, 16, 83, 150)


def _inputs(lens: tuple[int, ...], num_kv_heads: int, dtype: torch.dtype, seed: int) -> PagedInputs:
    gen = torch.Generator().manual_seed(seed)
    return make_paged_inputs(list(lens), 16, num_kv_heads, 32, 1, 32, dtype, "cpu", generator=gen)


def _query(inputs: PagedInputs, num_q: int, num_heads: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1000)
    batch = inputs.seq_lens.shape[0]
    return torch.randn(batch, num_q, num_heads, inputs.k_cache.shape[-1], generator=gen).to(dtype)


def _check(lens: tuple[int, ...], group: int, num_q: int, num_splits: int | None,
           dtype: torch.dtype = torch.float32, seed: int = 0, atol: float = 2e-5) -> None:
    inputs = _inputs(lens, 2, dtype, seed)
    q = _query(inputs, num_q, 2 * group, dtype, seed)
    want = naive_dense_decode(q.float(), inputs.k_cache.float(), inputs.v_cache.float(),
                              inputs.block_tables, inputs.seq_lens)
    got = paged.dense_decode(q, inputs.k_cache, inputs.v_cache, inputs.block_tables, inputs.seq_lens,
                             num_splits=num_splits)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=1e-3)


@pytest.mark.parametrize(("group", "num_splits"), [(1, 3), (4, 3), (6, 3), (16, 3), (4, 1), (4, None)])
def test_decode_matches_reference(group: int, num_splits: int | None) -> None:
    _check(LENS, group, 1, num_splits, seed=group)


def test_several_queries_per_sequence_are_causal() -> None:
    # The 3 queries of a sequence sit at its last 3 positions: each sees a different key count.
    _check((3, 17, 150), 4, 3, 5, seed=11)


def test_more_splits_than_pages() -> None:
    # 16 splits of sequences of 1–10 pages: the empty splits must weigh nothing in the merge.
    _check(LENS, 4, 1, 16, seed=5)


def test_fp16() -> None:
    _check(LENS, 4, 1, 2, dtype=torch.float16, seed=7, atol=2e-3)


def test_reads_only_the_pages_of_each_sequence() -> None:
    """Pages outside a sequence's first ceil(seq_len / P) table entries are never read: every other
    page of the pool is NaN, and the table entries past each sequence point at one of them."""
    inputs = _inputs(LENS, 2, torch.float32, 3)
    used = torch.zeros(inputs.k_cache.shape[0], dtype=torch.bool)
    for b, length in enumerate(inputs.seq_lens.tolist()):
        used[inputs.block_tables[b, : -(-length // 16)].long()] = True
    poison = int((~used).nonzero()[0])
    k_cache, v_cache = inputs.k_cache.clone(), inputs.v_cache.clone()
    k_cache[~used], v_cache[~used] = float("nan"), float("nan")
    tables = torch.where(inputs.block_tables < 0, poison, inputs.block_tables)
    tables = torch.cat([tables, torch.full((len(LENS), 3), poison, dtype=torch.int32)], dim=1)
    q = _query(inputs, 1, 8, torch.float32, 3)
    want = naive_dense_decode(q, inputs.k_cache, inputs.v_cache, inputs.block_tables, inputs.seq_lens)
    for num_splits in (1, 4):
        got = paged.dense_decode(q, k_cache, v_cache, tables, inputs.seq_lens, num_splits=num_splits)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-3)


def test_cuda_graph_padding_row() -> None:
    """A CUDA-graph padding row: one token on a scratch page, -1 everywhere else in its table."""
    inputs = _inputs((40, 1), 2, torch.float32, 9)
    tables = inputs.block_tables.clone()
    tables[1, 1:] = -1
    q = _query(inputs, 1, 4, torch.float32, 9)
    want = naive_dense_decode(q, inputs.k_cache, inputs.v_cache, tables, inputs.seq_lens)
    got = paged.dense_decode(q, inputs.k_cache, inputs.v_cache, tables, inputs.seq_lens, num_splits=2)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-3)
    # The single key of the padding row: its output is that key's value, exactly.
    page = int(tables[1, 0])
    torch.testing.assert_close(got[1, 0, :2], inputs.v_cache[page, 0, :1].expand(2, -1))


@pytest.mark.parametrize("q_lens", [(1, 5, 1, 16, 0), (1, 1, 1, 1, 1), (3, 5, 2, 16, 7)])
def test_mixed_step_sends_decode_rows_to_the_paged_kernel(q_lens: tuple[int, ...]) -> None:
    """A prefill step with decodes riding along (continuous batching): the one-token rows take the
    paged kernel, the others SDPA; together they equal the dense reference."""
    lens = (40, 83, 150, 16, 70)
    inputs = _inputs(lens, 2, torch.float32, 13)
    q = torch.randn(sum(q_lens), 8, 32, generator=torch.Generator().manual_seed(13))
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    args = (inputs.k_cache, inputs.v_cache, inputs.block_tables, inputs.seq_lens, cu)
    torch.testing.assert_close(gpu_ops.dense_prefill(q, *args), naive_dense_prefill(q, *args),
                               atol=2e-5, rtol=1e-3)


def test_rejects_bad_inputs() -> None:
    inputs = _inputs((20, 40), 2, torch.float32, 1)
    args = (inputs.k_cache, inputs.v_cache, inputs.block_tables, inputs.seq_lens)
    with pytest.raises(ValueError, match="Hq=3 is not a multiple of Hkv=2"):
        paged.dense_decode(torch.randn(2, 1, 3, 32), *args)
    with pytest.raises(ValueError, match="seq_lens has shape"):
        paged.dense_decode(torch.randn(2, 1, 4, 32), *args[:3], inputs.seq_lens[:1])
    with pytest.raises(ValueError, match="num_splits=0"):
        paged.dense_decode(torch.randn(2, 1, 4, 32), *args, num_splits=0)
    with pytest.raises(ValueError, match="powers of two"):
        small = inputs.k_cache[..., :24].contiguous()
        paged.dense_decode(torch.randn(2, 1, 4, 24), small, small, *args[2:])


def test_split_heuristic_fills_the_gpu_and_is_a_power_of_two() -> None:
    device = torch.device("cpu")  # num_sms = 8 off CUDA: 32 CTAs wanted
    assert paged.default_num_splits(4, 1563, device) == 8  # cdiv(32, 4) = 8
    assert paged.default_num_splits(2, 1563, device) == 16
    assert paged.default_num_splits(3, 1563, device) == 8  # cdiv(32, 3) = 11 → 8
    assert paged.default_num_splits(64, 1563, device) == 1
    assert paged.default_num_splits(1, 3, device) == 2  # never more than the table's pages


def test_dense_backend_decodes_with_the_paged_kernel_on_cuda() -> None:
    ops = get_ops("dense", "cuda")
    assert ops.dense_decode.__module__ == "msaserve.kernels.dense.gpu" and ops.graph_capturable
    assert ops.dense_prefill.__module__ == "msaserve.kernels.dense.gpu"
    msa = get_ops("triton", "cuda")  # the MSA backend's full-attention layers: the same capturable ops
    assert msa.dense_decode is ops.dense_decode and msa.dense_prefill is ops.dense_prefill
    assert msa.graph_capturable
    cpu = get_ops("dense", "cpu")
    assert cpu.dense_decode.__module__ == "msaserve.kernels.dense.sdpa" and not cpu.graph_capturable


def test_dense_backend_decode_measures_nothing_while_serving(monkeypatch) -> None:
    """The dense backend's decode is the paged kernel eagerly as in CUDA graphs: no selector
    measurement runs inside a serving step (timing paged against gathered decode per batch and KV
    bucket put seconds of measurements into an H200 run's timed window), and it computes the dense
    reference's output."""
    from msaserve.kernels.dense import select

    timed = []

    def timer(name, fn):
        timed.append(name)
        return 1.0

    monkeypatch.setattr(select, "_DEFAULT", select.DenseSelector(timer=timer))
    for batch_lens in ((40, 150), (7, 33, 90)):
        inputs = _inputs(batch_lens, 2, torch.float32, 21)
        q = _query(inputs, 2, 8, torch.float32, 21)
        args = (inputs.k_cache, inputs.v_cache, inputs.block_tables, inputs.seq_lens)
        got = gpu_ops.dense_decode(q, *args)
        torch.testing.assert_close(got, naive_dense_decode(q, *args), atol=2e-5, rtol=1e-3)
    assert timed == [] and select._DEFAULT.measurements == 0
