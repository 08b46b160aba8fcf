"""Every dense attention candidate (msaserve/kernels/dense/candidates.py) on a CUDA GPU at the M3
head layout (Hq 64, Hkv 4, D 128) against a float64 reference, for each mask kind; and the dense
backend's selector-driven prefill and decode against the naive dense ops."""

import itertools
import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from kernel_inputs import make_paged_inputs

from msaserve.kernels.dense import gpu
from msaserve.kernels.dense.candidates import CANDIDATES, Unsupported, mask_kind
from msaserve.kernels.dense.naive import dense_decode as naive_dense_decode
from msaserve.kernels.dense.naive import dense_prefill as naive_dense_prefill
from msaserve.kernels.dense.select import DenseSelector, key_for

BF16 = torch.bfloat16
# Optional packages (flash-attn-4) and backends a GPU may lack: they must refuse, never be wrong.
MAY_REFUSE = {"fa4", "sdpa_cudnn", "sdpa_cudnn_gqa", "sdpa_efficient", "cudnn_split"}


def _reference(q, k, v, scale):
    q_len, kv_len = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    logits = q.double() @ k.transpose(-1, -2) * scale
    pos = torch.arange(q_len, device=q.device)[:, None] + kv_len - q_len
    visible = torch.arange(kv_len, device=q.device)[None, :] <= pos
    return torch.softmax(logits.masked_fill(~visible, float("-inf")), -1) @ v


def _inputs(batch, q_len, kv_len, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, 64, q_len, 128, device="cuda", generator=gen).to(BF16)
    k = torch.randn(batch, 4, kv_len, 128, device="cuda", generator=gen).to(BF16)
    return q, k, torch.randn(batch, 4, kv_len, 128, device="cuda", generator=gen).to(BF16)


# (batch, q_len, kv_len): causal (odd length), chunk, 8 decode queries (MTP), one decode query.
SHAPES = [(1, 1000, 1000), (1, 300, 2177), (2, 8, 3000), (3, 1, 4100)]


@pytest.mark.parametrize("name", list(CANDIDATES))
@pytest.mark.parametrize(("batch", "q_len", "kv_len"), SHAPES)
def test_candidate_matches_reference(name: str, batch: int, q_len: int, kv_len: int) -> None:
    candidate = CANDIDATES[name]
    if mask_kind(q_len, kv_len) not in candidate.kinds:
        pytest.skip(f"{name} does not compute {mask_kind(q_len, kv_len)}")
    q, k, v = _inputs(batch, q_len, kv_len, seed=q_len)
    scale = 1 / math.sqrt(128)
    try:
        got = candidate.fn(q, k, v, scale)
    except Unsupported as exc:
        if name in MAY_REFUSE:
            pytest.skip(f"{name} refused: {exc}")
        raise
    want = _reference(q, k, v, scale)
    assert got.shape == q.shape
    err = float((got.double() - want).norm() / want.norm())
    assert err < 1e-2, f"{name}: relative error {err:.3g}"


def test_selector_measures_every_candidate_once() -> None:
    selector = DenseSelector()
    q, k, v = _inputs(1, 512, 4096, seed=3)
    scale = 1 / math.sqrt(128)
    out = selector.attention(q, k, v, scale)
    choice = selector.choices[key_for(q, k).text()]
    assert choice.winner in choice.times_ms and {"sdpa_flash", "flex"} <= set(choice.times_ms)
    assert float((out.double() - _reference(q, k, v, scale)).norm() / out.double().norm()) < 1e-2
    selector.attention(q, k, v, scale)
    assert selector.measurements == 1


def test_backend_prefill_and_decode_match_naive() -> None:
    """The dense backend through its selector: a whole prompt, a chunk at the end of a long KV, and
    decode rows (mixed into one step, as continuous batching does), then a decode step."""
    lens, q_lens = (3000, 1200, 777), (3000, 200, 1)
    gen = torch.Generator().manual_seed(5)
    inputs = make_paged_inputs(list(lens), 128, 4, 128, 1, 128, BF16, "cuda", generator=gen)
    q = torch.randn(sum(q_lens), 64, 128, generator=gen).to("cuda", BF16)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device="cuda")
    args = (inputs.k_cache, inputs.v_cache, inputs.block_tables, inputs.seq_lens, cu)
    want = naive_dense_prefill(q.float(), *(a.float() if a.is_floating_point() else a for a in args))
    torch.testing.assert_close(gpu.dense_prefill(q, *args).float(), want, atol=2e-2, rtol=2e-2)
    qd = torch.randn(3, 2, 64, 128, generator=gen).to("cuda", BF16)
    cache_args = (inputs.block_tables, inputs.seq_lens)
    want = naive_dense_decode(qd.float(), inputs.k_cache.float(), inputs.v_cache.float(), *cache_args)
    got = gpu.dense_decode(qd, inputs.k_cache, inputs.v_cache, *cache_args)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
