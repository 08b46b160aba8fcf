"""Split lower-right attention (msaserve/kernels/dense/split.py): a mask-free part with the group's
query heads folded into the query axis plus a square causal part, merged by LSE, equals lower-right
causal GQA attention. Run here with the plain-PyTorch LSE op; tests/gpu runs cuDNN's and flash's."""

import pytest
import torch

from msaserve.kernels.dense.split import SplitUnsupported, math_lse, merge, split_attention, split_lower_right


def reference(q, k, v, scale):
    q_len, kv_len = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    logits = q.double() @ k.transpose(-1, -2) * scale
    visible = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + kv_len - q_len
    return torch.softmax(logits.masked_fill(~visible, float("-inf")), -1) @ v


@pytest.mark.parametrize(("batch", "hq", "hkv", "q_len", "kv_len"),
                         [(1, 8, 2, 5, 70), (2, 12, 3, 8, 9), (3, 4, 4, 31, 200), (1, 16, 1, 8, 1000)])
def test_split_equals_lower_right_causal(batch, hq, hkv, q_len, kv_len) -> None:
    gen = torch.Generator().manual_seed(q_len + kv_len)
    q = torch.randn(batch, hq, q_len, 16, generator=gen)
    k, v = torch.randn(2, batch, hkv, kv_len, 16, generator=gen)
    got = split_attention(math_lse, q, k, v, 0.3)
    torch.testing.assert_close(got.double(), reference(q, k, v, 0.3), atol=1e-5, rtol=1e-4)


def test_merge_of_disjoint_key_sets() -> None:
    """Attention over keys A ∪ B from the parts over A and over B."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 3, 8, generator=gen)
    k, v = torch.randn(2, 1, 2, 20, 8, generator=gen)
    whole, _ = math_lse(q, k, v, 0.5, False)
    o_a, lse_a = math_lse(q, k[:, :, :7], v[:, :, :7], 0.5, False)
    o_b, lse_b = math_lse(q, k[:, :, 7:], v[:, :, 7:], 0.5, False)
    torch.testing.assert_close(merge(o_a, lse_a, o_b, lse_b), whole, atol=1e-6, rtol=1e-5)


def test_refuses_what_is_not_a_chunk() -> None:
    run = split_lower_right("math")
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(SplitUnsupported, match="Tq=4, T=4"):
        run(q, k, k, 0.5)
    with pytest.raises(SplitUnsupported, match="cudnn needs CUDA"):
        split_lower_right("cudnn")(q, torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8), 0.5)
