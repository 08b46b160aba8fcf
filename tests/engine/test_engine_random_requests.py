"""~1,000 random requests (lengths, shared prefixes, aborts) through a small page pool, so that
prefix hits, evictions and preemptions (by swap and by recompute) all happen. Afterwards every
request has exactly one final output and every page is free."""

from collections import Counter

import torch
from engine_helpers import make_engine
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from msaserve.engine.types import GenerateRequest, SamplingParams

PREFIXES = [
    torch.randint(3, 512, (80,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(3)
]

request_spec = st.fixed_dictionaries({
    "prefix": st.integers(-1, len(PREFIXES) - 1),  # -1: no shared prefix
    "prefix_len": st.integers(1, 80),
    "suffix": st.lists(st.integers(3, 511), min_size=0, max_size=40),
    "max_tokens": st.integers(1, 40),
    "arrive_after": st.integers(0, 3),  # steps after the previous request
    "abort_after": st.one_of(st.none(), st.integers(0, 12)),  # steps after arrival
})


def prompt_of(spec: dict) -> list[int]:
    prefix = PREFIXES[spec["prefix"]][: spec["prefix_len"]] if spec["prefix"] >= 0 else []
    return (prefix + spec["suffix"]) or [5]


def test_random_traffic_answers_everything_and_frees_every_page(tiny_model):
    totals: Counter[str] = Counter()

    # No shrinking: a failure prints its example, and shrinking 200 requests would take minutes.
    @settings(max_examples=5, deadline=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(specs=st.lists(request_spec, min_size=200, max_size=200))
    def run(specs: list[dict]) -> None:
        totals.update(run_traffic(tiny_model, specs))

    run()
    print(dict(totals))
    # Over the examples, the pool was small enough for the paths this test is about.
    assert totals["preemptions"] > 0 and totals["evictions"] > 0 and totals["hit_tokens"] > 0


def run_traffic(tiny_model, specs: list[dict]) -> Counter[str]:
    # 16 pages × 16 tokens; a swap store of ~12 pages, so some preemptions must recompute.
    engine = make_engine(tiny_model, num_pages=16, max_num_seqs=8, max_num_batched_tokens=48,
                         swap_space_bytes=12 * 10_240, max_waiting=10_000)
    arrivals: dict[int, list[int]] = {}
    step = 0
    for i, spec in enumerate(specs):
        step += spec["arrive_after"]
        arrivals.setdefault(step, []).append(i)
    aborts: dict[int, list[int]] = {}
    events = []
    finals: dict[str, list] = {}
    tokens: dict[str, list[int]] = {}
    step = 0
    while arrivals or engine.has_unfinished():
        for i in arrivals.pop(step, []):
            spec = specs[i]
            params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
            engine.add_request(GenerateRequest(f"r{i}", prompt_of(spec), params))
            if spec["abort_after"] is not None:
                aborts.setdefault(step + spec["abort_after"], []).append(i)
        outputs = engine.step()
        outputs += [o for i in aborts.pop(step, []) if (o := engine.abort(f"r{i}")) is not None]
        for output in outputs:
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
            if output.finished:
                finals.setdefault(output.request_id, []).append(output)
        step += 1
        engine.block_manager.check_consistency()
        if step % 25 == 0:
            events.extend(engine.drain_kv_events())

    assert sorted(finals) == sorted(f"r{i}" for i in range(len(specs)))
    assert all(len(f) == 1 for f in finals.values()), "a request finished twice"
    for i, spec in enumerate(specs):
        final = finals[f"r{i}"][0]
        if final.finish_reason == "length":
            assert len(tokens[f"r{i}"]) == spec["max_tokens"]
        else:
            assert final.finish_reason == "abort" and spec["abort_after"] is not None
    manager = engine.block_manager
    assert manager.num_free_pages == manager.num_pages and not any(manager.ref_counts)
    assert len(engine.swapper.store) == 0 and not engine.trackers
    # Greedy: the same prompt gives the same tokens whether it hit the cache, was preempted or not.
    by_prompt: dict[tuple, list[int]] = {}
    for i, spec in enumerate(specs):
        out, key = tokens.get(f"r{i}", []), tuple(prompt_of(spec))
        seen = by_prompt.setdefault(key, out)
        n = min(len(seen), len(out))
        assert seen[:n] == out[:n], f"request r{i} diverged from an earlier run of the same prompt"
        if len(out) > len(seen):
            by_prompt[key] = out
    engine_stats = engine.stats()
    assert engine_stats.num_running == engine_stats.num_waiting == 0
    events += engine.drain_kv_events()
    return Counter(
        preemptions=engine.scheduler.num_preemptions, hit_tokens=manager.num_hit_tokens,
        evictions=sum(len(e.page_hashes) for e in events if e.kind == "removed"),
    )
