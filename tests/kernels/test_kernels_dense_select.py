"""The dense-attention selector (msaserve/kernels/dense/select.py): the fastest candidate per shape
key, measured once, cached in memory and on disk; refusing or wrong candidates skipped. Timings are
injected (CPU tests); the candidates' outputs are compared with the naive reference where they run
here (SDPA on CPU; tests/gpu/test_gpu_dense_select.py runs every candidate on CUDA)."""

import json

import pytest
import torch
import torch.nn.functional as F

from msaserve.kernels.dense import candidates as cands
from msaserve.kernels.dense.candidates import Candidate, Unsupported, mask_kind
from msaserve.kernels.dense.select import Choice, DenseSelector, bucket, key_for

ALL = frozenset(cands.MASK_KINDS)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 lower-right causal GQA attention: query i sees keys ≤ T - Tq + i."""
    q_len, kv_len = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    logits = q.double() @ k.transpose(-1, -2) * scale
    visible = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + kv_len - q_len
    return torch.softmax(logits.masked_fill(~visible, float("-inf")), -1) @ v


def inputs(q_len: int, kv_len: int, batch: int = 2, hq: int = 8, hkv: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, q_len, 16, generator=gen)
    k = torch.randn(batch, hkv, kv_len, 16, generator=gen)
    return q, k, torch.randn(batch, hkv, kv_len, 16, generator=gen)


def sdpa_plain(q, k, v, scale):
    return cands._sdpa_default(q, k, v, scale)


def fake(name: str, fn=sdpa_plain, kinds=ALL) -> Candidate:
    return Candidate(name, kinds, fn, cuda_only=False)


class Timings:
    """An injected timer: fixed ms per candidate name; counts the calls it timed."""

    def __init__(self, ms: dict[str, float]):
        self.ms, self.calls = ms, []

    def __call__(self, name, fn):
        fn()
        self.calls.append(name)
        return self.ms[name]


@pytest.mark.parametrize(("q_len", "kv_len"), [(37, 37), (5, 70), (1, 70), (8, 8)])
def test_sdpa_default_matches_reference_for_every_mask_kind(q_len: int, kv_len: int) -> None:
    q, k, v = inputs(q_len, kv_len, seed=q_len)
    got = cands._sdpa_default(q, k, v, 0.25)
    torch.testing.assert_close(got.double(), reference(q, k, v, 0.25), atol=1e-5, rtol=1e-4)


def test_decode_fold_is_the_same_attention() -> None:
    """One query per sequence: the group's heads folded into the query axis give GQA's output."""
    q, k, v = inputs(1, 50, hq=12, hkv=3, seed=4)
    folded = F.scaled_dot_product_attention(cands._fold_decode(q, k), k, v, scale=0.3).reshape(q.shape)
    torch.testing.assert_close(folded.double(), reference(q, k, v, 0.3), atol=1e-5, rtol=1e-4)


def test_mask_kinds() -> None:
    assert [mask_kind(1, 9), mask_kind(9, 9), mask_kind(4, 9)] == ["decode", "causal", "chunk"]
    with pytest.raises(ValueError, match="q_len=10, kv_len=9"):
        mask_kind(10, 9)


def test_picks_the_fastest_and_measures_once_per_key() -> None:
    timer = Timings({"a": 3.0, "b": 1.0, "c": 2.0})
    sel = DenseSelector({n: fake(n) for n in "abc"}, timer=timer)
    q, k, v = inputs(40, 40)
    out = sel.attention(q, k, v, 0.25)
    torch.testing.assert_close(out.double(), reference(q, k, v, 0.25), atol=1e-5, rtol=1e-4)
    choice = sel.choices[key_for(q, k).text()]
    assert choice.winner == "b" and choice.times_ms == {"a": 3.0, "b": 1.0, "c": 2.0}
    sel.attention(*inputs(33, 33, seed=1), 0.25)  # same bucket (64): no new measurement
    assert sel.measurements == 1 and len(timer.calls) == 3
    sel.attention(*inputs(8, 40), 0.25)  # a chunk: its own key
    assert sel.measurements == 2


def test_kinds_restrict_the_candidates() -> None:
    timer = Timings({"causal_only": 0.1, "any": 1.0})
    sel = DenseSelector({"causal_only": fake("causal_only", kinds=frozenset({"causal"})), "any": fake("any")},
                        timer=timer)
    q, k, v = inputs(8, 40)
    sel.attention(q, k, v, 0.25)
    assert sel.choices[key_for(q, k).text()].winner == "any" and timer.calls == ["any"]


def test_refusing_and_wrong_candidates_are_skipped() -> None:
    def refuses(q, k, v, scale):
        raise Unsupported("no kernel for this")

    def wrong_scale(q, k, v, scale):
        return sdpa_plain(q, k, v, scale * 2)

    timer = Timings({"ok": 5.0, "refuses": 0.1, "wrong": 0.1})
    pool = {"ok": fake("ok"), "refuses": fake("refuses", refuses), "wrong": fake("wrong", wrong_scale)}
    sel = DenseSelector(pool, timer=timer)
    q, k, v = inputs(20, 20)
    sel.attention(q, k, v, 0.25)
    choice = sel.choices[key_for(q, k).text()]
    assert choice.winner == "ok" and timer.calls == ["ok"]
    assert "no kernel for this" in choice.errors["refuses"] and "rel err" in choice.errors["wrong"]


def test_no_candidate_runs() -> None:
    def refuses(q, k, v, scale):
        raise Unsupported("never")

    sel = DenseSelector({"x": fake("x", refuses)}, timer=Timings({}))
    with pytest.raises(RuntimeError, match=r"no dense attention candidate ran.*never"):
        sel.attention(*inputs(4, 4), 0.25)


def test_disk_cache_is_read_by_a_new_selector(tmp_path) -> None:
    path = tmp_path / "dense.json"
    first = DenseSelector({n: fake(n) for n in "ab"}, timer=Timings({"a": 2.0, "b": 1.0}), cache_path=path)
    q, k, v = inputs(1, 300)
    first.attention(q, k, v, 0.25)
    saved = json.loads(path.read_text())
    assert [entry["winner"] for entry in saved.values()] == ["b"]

    never = Timings({})  # a KeyError if the new selector timed anything
    second = DenseSelector({n: fake(n) for n in "ab"}, timer=never, cache_path=path)
    second.attention(q, k, v, 0.25)
    assert never.calls == [] and second.measurements == 0


def test_cached_winner_that_is_gone_is_measured_again(tmp_path) -> None:
    path = tmp_path / "dense.json"
    DenseSelector({n: fake(n) for n in "ab"}, timer=Timings({"a": 2.0, "b": 1.0}),
                  cache_path=path).attention(*inputs(9, 9), 0.25)
    timer = Timings({"a": 2.0})
    again = DenseSelector({"a": fake("a")}, timer=timer, cache_path=path)  # "b" no longer installed
    again.attention(*inputs(9, 9), 0.25)
    assert timer.calls == ["a"] and again.measurements == 1


def test_cpu_without_a_timer_runs_sdpa_unmeasured() -> None:
    sel = DenseSelector()
    q, k, v = inputs(6, 30)
    torch.testing.assert_close(sel.attention(q, k, v, 0.25).double(), reference(q, k, v, 0.25),
                               atol=1e-5, rtol=1e-4)
    assert sel.measurements == 0 and sel.choices == {}


def test_only_sdpa_applies_on_cpu() -> None:
    names = {kind: [c.name for c in cands.applicable(kind, torch.device("cpu"))] for kind in cands.MASK_KINDS}
    assert names == {kind: ["sdpa_default"] for kind in cands.MASK_KINDS}
    cuda_chunk = [c.name for c in cands.applicable("chunk", torch.device("cuda"))]
    assert "sdpa_cudnn" not in cuda_chunk and "sdpa_flash" in cuda_chunk and "flex" in cuda_chunk


def test_bucket() -> None:
    assert [bucket(n) for n in (1, 2, 3, 64, 65, 131072, 131073)] == [1, 2, 4, 64, 128, 131072, 262144]


def test_recorded_choice_is_used_without_measuring(tmp_path) -> None:
    """A benchmark records its measured choice into a cache file; a serving selector reading that file
    runs the recorded winner and times nothing."""
    path = tmp_path / "dense.json"
    q, k, v = inputs(16, 64)
    bench = DenseSelector({n: fake(n) for n in "ab"}, cache_path=path)
    bench.record(key_for(q, k), Choice("a", {"a": 1.0, "b": 2.0}))
    never = Timings({})
    serving = DenseSelector({n: fake(n) for n in "ab"}, timer=never, cache_path=path)
    torch.testing.assert_close(serving.attention(q, k, v, 0.25).double(), reference(q, k, v, 0.25),
                               atol=1e-5, rtol=1e-4)
    assert never.calls == [] and serving.measurements == 0


def test_the_engine_selector_never_offers_a_per_shape_compiled_candidate(monkeypatch):
    """FlexAttention compiles per exact length: measured at one length of a bucket, it recompiled at
    every other and, past torch's recompile limit, ran an unfused path that materialised the scores
    (m3-mini on the H200, 2026-12-03: dense decode 1.7 s per token at c = 32). The engine's selector,
    whose one measurement serves a whole bucket, must not be able to pick it."""
    from msaserve.kernels.dense import candidates, select

    monkeypatch.setattr(select, "_DEFAULT", None)
    offered = select.default_selector().candidates
    assert candidates.CANDIDATES["flex"].exact_shape
    assert "flex" not in offered
    assert set(offered) == {n for n, c in candidates.CANDIDATES.items() if not c.exact_shape}
    assert "sdpa_default" in offered


def test_batch_sizes_of_one_bucket_share_a_measurement() -> None:
    """A continuous batch decodes 5 sequences in one step and 7 in the next: one measurement serves
    both (exact batch sizes made the dense engine measure in most mixed steps at concurrency 32)."""
    timer = Timings({"a": 1.0, "b": 2.0})
    sel = DenseSelector({"a": fake("a"), "b": fake("b")}, timer=timer)
    for batch in (5, 7, 8):
        q, k, v = inputs(1, 40, batch=batch, seed=batch)
        torch.testing.assert_close(sel.attention(q, k, v, 0.25).double(), reference(q, k, v, 0.25),
                                   atol=1e-5, rtol=1e-4)
    assert sel.measurements == 1 and key_for(*inputs(1, 40, batch=5)[:2]).batch == 8
    sel.attention(*inputs(1, 40, batch=9), 0.25)  # the next bucket: measured
    assert sel.measurements == 2


def test_pretune_measures_every_chunk_key_before_serving() -> None:
    """After pretune, prefill chunks of the tuned sizes over any KV length up to the maximum
    measure nothing more: the measurements ran before the first step, not inside it."""
    timer = Timings({"a": 1.0, "b": 2.0})
    sel = DenseSelector({"a": fake("a"), "b": fake("b")}, timer=timer)
    measured = sel.pretune(8, 2, 16, torch.float32, "cpu", q_lens=[3, 8], max_kv_len=40)
    # q bucket 4: kv 4 (causal), 8, 16, 32, 64; q bucket 8: kv 8 (causal), 16, 32, 64
    assert measured == 9 == sel.measurements
    for q_len, kv_len in [(3, 3), (3, 37), (8, 40), (5, 21), (4, 9)]:
        q, k, v = inputs(q_len, kv_len, batch=1, seed=q_len + kv_len)
        torch.testing.assert_close(sel.attention(q, k, v, 0.25).double(), reference(q, k, v, 0.25),
                                   atol=1e-5, rtol=1e-4)
    assert sel.measurements == 9
    assert DenseSelector(timer=None).pretune(8, 2, 16, torch.float32, "cpu", [8], 40) == 0
