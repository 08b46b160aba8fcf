"""Checks of the Triton MSA ops against the naive spec, shared by the CPU interpreter tests
(test_kernels_triton.py) and the GPU tests (tests/gpu/test_gpu_kernels_triton.py). No tests here.

Every check draws fresh random inputs with scattered physical pages, poisons freshly allocated
memory (torch fills uninitialised tensors with NaN / max-int in deterministic mode), and compares:
selections as sets up to near-ties (docs/design.md §2 property 4), attention outputs given the same
selection, with the selection slots shuffled (property 3).
"""

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from kernel_inputs import PagedInputs, make_paged_inputs, reference_scores
from kernel_testing import selections_match


@dataclass(frozen=True)
class Shape:
    seq_lens: tuple[int, ...]
    page_size: int
    num_kv_heads: int
    group: int
    head_dim: int
    index_heads: int  # HkI: 1 or num_kv_heads
    top_k: int
    n_init: int = 1
    n_local: int = 1  # forced blocks ending at the query's block (M3: index_local_blocks, with n_init 0)


@dataclass(frozen=True)
class Ops:
    """The ops under test and the reference, as (q, caches, …) callables with naive signatures."""

    indexer_decode: Callable[..., torch.Tensor]
    indexer_prefill: Callable[..., torch.Tensor]
    sparse_decode: Callable[..., torch.Tensor]
    sparse_prefill: Callable[..., torch.Tensor]


@contextlib.contextmanager
def poisoned_allocations() -> Iterator[None]:
    """torch.empty returns NaN (floats) / max-int (ints) inside: unwritten outputs show up."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def _inputs(shape: Shape, dtype: torch.dtype, device: str, fp8: bool, seed: int) -> PagedInputs:
    gen = torch.Generator().manual_seed(seed)
    return make_paged_inputs(list(shape.seq_lens), shape.page_size, shape.num_kv_heads, shape.head_dim,
                             shape.index_heads, shape.head_dim, dtype, device, fp8_index=fp8, generator=gen)


def _shuffle_slots(selected: torch.Tensor, seed: int) -> torch.Tensor:
    """Permute each row's K slots (property 3: the order must not matter)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.rand(selected.shape, generator=gen).to(selected.device)
    return torch.gather(selected, -1, torch.argsort(keys, dim=-1)).contiguous()


def _score_tolerance(shape: Shape) -> float:
    return 2e-3 * math.sqrt(shape.head_dim)


def _check_selection(got, want, q_index_flat, inputs, cu, shape, name):
    assert got.dtype == torch.int32 and got.shape == want.shape, f"{name}: {got.dtype} {tuple(got.shape)}"
    assert int(got.max()) < inputs.block_tables.shape[1] and int(got.min()) >= -1, f"{name}: ids out of range"
    scores = reference_scores(q_index_flat, inputs, cu)
    flat_got, flat_want = got.reshape(-1, *got.shape[-2:]), want.reshape(-1, *want.shape[-2:])
    ok, message = selections_match(flat_got.cpu(), flat_want.cpu(), scores.cpu(), _score_tolerance(shape))
    assert ok, f"{name}: {message}"


def _decode_cu(batch: int, num_q: int, device: str) -> torch.Tensor:
    return torch.arange(batch + 1, dtype=torch.int32, device=device) * num_q


def check_indexer_decode(ops: Ops, ref: Ops, shape: Shape, num_q: int, dtype: torch.dtype, device: str,
                         fp8: bool = False, seed: int = 0) -> None:
    inputs = _inputs(shape, dtype, device, fp8, seed)
    batch = len(shape.seq_lens)
    gen = torch.Generator().manual_seed(seed + 1)
    q_index = torch.randn(batch, num_q, shape.num_kv_heads, shape.head_dim, generator=gen).to(device, dtype)
    args = (inputs.index_cache, inputs.block_tables, inputs.seq_lens, shape.top_k, shape.n_init,
            inputs.index_scale)
    with poisoned_allocations():
        got = ops.indexer_decode(q_index, *args, n_local=shape.n_local)
    want = ref.indexer_decode(q_index, *args, n_local=shape.n_local)
    flat_q = q_index.reshape(batch * num_q, *q_index.shape[2:])
    _check_selection(got, want, flat_q, inputs, _decode_cu(batch, num_q, device), shape, "indexer_decode")


def _chunks(shape: Shape, seed: int) -> list[int]:
    """A prefill chunk length per sequence: the whole sequence for some, a suffix for others."""
    gen = torch.Generator().manual_seed(seed + 2)
    return [n if b % 2 == 0 else 1 + int(torch.randint(n, (1,), generator=gen))
            for b, n in enumerate(shape.seq_lens)]


def check_indexer_prefill(ops: Ops, ref: Ops, shape: Shape, dtype: torch.dtype, device: str,
                          fp8: bool = False, seed: int = 0) -> None:
    inputs = _inputs(shape, dtype, device, fp8, seed)
    chunks = _chunks(shape, seed)
    cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(seed + 1)
    q_index = torch.randn(sum(chunks), shape.num_kv_heads, shape.head_dim, generator=gen).to(device, dtype)
    args = (inputs.index_cache, inputs.block_tables, inputs.seq_lens, cu, shape.top_k, shape.n_init,
            inputs.index_scale)
    with poisoned_allocations():
        got = ops.indexer_prefill(q_index, *args, n_local=shape.n_local)
    want = ref.indexer_prefill(q_index, *args, n_local=shape.n_local)
    _check_selection(got, want, q_index, inputs, cu, shape, "indexer_prefill")


def _attention_tolerance(dtype: torch.dtype) -> dict:
    return {"atol": 2e-4, "rtol": 2e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def check_sparse_decode(ops: Ops, ref: Ops, shape: Shape, num_q: int, dtype: torch.dtype, device: str,
                        seed: int = 0) -> None:
    inputs = _inputs(shape, dtype, device, False, seed)
    batch, num_heads = len(shape.seq_lens), shape.num_kv_heads * shape.group
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(batch, num_q, num_heads, shape.head_dim, generator=gen).to(device, dtype)
    q_index = q.view(batch, num_q, shape.num_kv_heads, shape.group, shape.head_dim).mean(3)
    selected = ref.indexer_decode(q_index, inputs.index_cache, inputs.block_tables, inputs.seq_lens,
                                  shape.top_k, shape.n_init, n_local=shape.n_local)
    args = (inputs.k_cache, inputs.v_cache, inputs.block_tables, inputs.seq_lens)
    with poisoned_allocations():
        got = ops.sparse_decode(q, *args, _shuffle_slots(selected, seed))
    want = ref.sparse_decode(q, *args, selected)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert not got.isnan().any(), "sparse_decode left NaN (unwritten or poisoned) outputs"
    torch.testing.assert_close(got.float(), want.float(), **_attention_tolerance(dtype))


def _drop_slots(selected: torch.Tensor, seed: int) -> torch.Tensor:
    """Empty slots in the selection: every slot of KV head 0 for the first 40 queries (whole
    windows of queries with nothing selected for that head), and one random slot elsewhere."""
    gen = torch.Generator().manual_seed(seed + 3)
    selected = selected.clone()
    selected[:40, 0] = -1
    slot = torch.randint(selected.shape[-1], selected.shape[:2], generator=gen).to(selected.device)
    drop = torch.rand(selected.shape[:2], generator=gen).to(selected.device) < 0.3
    keep_one = (selected >= 0).sum(-1) > 1  # never empty a row here: the spec leaves those undefined
    current = selected.gather(-1, slot[..., None])
    selected.scatter_(-1, slot[..., None], torch.where((drop & keep_one)[..., None], -1, current))
    return selected


def check_sparse_prefill(ops: Ops, ref: Ops, shape: Shape, dtype: torch.dtype, device: str,
                         seed: int = 0, empty_slots: bool = False) -> None:
    """With empty_slots, some selections lose slots and some rows lose all of them: a row without
    any selected block must come out as zeros (the naive spec has no answer for it)."""
    inputs = _inputs(shape, dtype, device, False, seed)
    chunks = _chunks(shape, seed)
    cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32, device=device)
    num_heads = shape.num_kv_heads * shape.group
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(chunks), num_heads, shape.head_dim, generator=gen).to(device, dtype)
    q_index = q.view(-1, shape.num_kv_heads, shape.group, shape.head_dim).mean(2)
    selected = ref.indexer_prefill(q_index, inputs.index_cache, inputs.block_tables, inputs.seq_lens, cu,
                                   shape.top_k, shape.n_init, n_local=shape.n_local)
    args = (inputs.k_cache, inputs.v_cache, inputs.block_tables, inputs.seq_lens, cu)
    if empty_slots:
        selected = _drop_slots(selected, seed)
    with poisoned_allocations():
        got = ops.sparse_prefill(q, *args, _shuffle_slots(selected, seed))
    empty = (selected < 0).all(-1)  # [Tq, Hkv]
    want = ref.sparse_prefill(q, *args, torch.where(empty[..., None], 0, selected))
    want = want.view(q.shape[0], shape.num_kv_heads, shape.group, -1).masked_fill(empty[..., None, None], 0)
    want = want.view_as(q)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert not got.isnan().any(), "sparse_prefill left NaN (unwritten or poisoned) outputs"
    torch.testing.assert_close(got.float(), want.float(), **_attention_tolerance(dtype))
