"""Sparse-KV residency (engine/kv/resident_session.py): a session decoding with its whole index
and only a small working set of K/V pages on the device gives exactly the greedy tokens of the
fully resident session, evicting and fetching pages as the selection moves — offloaded locally or
adopted from the KV cache service.

tiny: P=16, K=4, Hkv=2, so one step selects at most 8 pages per layer; the 600-token session has
38 pages and the working set 10 or 12."""

import gc
import warnings

import pytest
import torch
from reference_decode import SequenceState
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from msaserve.engine.kv.pages import identity_for
from msaserve.engine.kv.persist import SessionWriter
from msaserve.engine.kv.residency import ResidencyBudgetError, WorkingSet
from msaserve.engine.kv.resident_graph import WARMUP_STEPS, SparseDecodeGraph
from msaserve.engine.kv.resident_session import ResidentSession
from msaserve.kernels import get_ops
from msaserve.kvcache.client import KVCacheClient
from msaserve.kvcache.config import ServiceConfig
from msaserve.models.presets import get_preset
from msaserve.models.transformer import MSATransformer, init_random_weights

PROMPT_LEN, STEPS = 600, 24  # decoding crosses a page boundary at 608: write-back and ring reuse


@pytest.fixture(scope="module")
def model() -> MSATransformer:
    return init_random_weights(MSATransformer(get_preset("tiny"), "msa"), seed=0).eval()


def resident_session(model, seed: int):
    """A fully resident session: its prompt, prefilled state (copied) and next STEPS greedy tokens."""
    prompt = torch.randint(3, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()
    with torch.inference_mode():
        state = SequenceState(model, PROMPT_LEN + STEPS + 1)
        hidden = state.prefill(prompt, chunk_size=128)[-1:]
        tokens = [int(torch.argmax(model.compute_logits(hidden)[0]))]
        snapshot = [(c.k_cache.clone(), c.v_cache.clone(), c.index_cache.clone()) for c in state.caches]
        for step in range(STEPS):
            hidden = state.forward([tokens[-1]], PROMPT_LEN + step, decode=True)
            tokens.append(int(torch.argmax(model.compute_logits(hidden)[0])))
        for cache, (k, v, index) in zip(state.caches, snapshot, strict=True):  # back to the prefill's end
            cache.k_cache.copy_(k)
            cache.v_cache.copy_(v)
            cache.index_cache.copy_(index)
    return prompt, state, tokens


@pytest.fixture(scope="module")
def resident(model):
    """The fully resident session: its prefilled state (copied) and its next STEPS greedy tokens."""
    return resident_session(model, seed=3)


@pytest.fixture(scope="module")
def other(model):
    """Another session of the same length (another prompt)."""
    return resident_session(model, seed=4)


def decode(model, session: ResidentSession, first_token: int, start: int, steps: int,
           prefetch_items: int = 0) -> list[int]:
    ops = session.wrap_ops(get_ops("msa", "cpu"))
    tokens = [first_token]
    with torch.inference_mode():
        for step in range(steps):
            meta = session.decode_metadata(start + step)
            hidden = model(torch.tensor([tokens[-1]]), meta, session.caches, ops=ops)
            tokens.append(int(torch.argmax(model.compute_logits(hidden)[0])))
            if prefetch_items:
                session.prefetch(prefetch_items)
    return tokens


def stored_session(model, prompt, state, want) -> KVCacheClient:
    """A client of 2 in-process shards holding the resident session as "long" (tail included)."""
    identity = identity_for(model.config, "tiny@seed0", torch.float32)
    client = KVCacheClient.in_process(ServiceConfig(num_shards=2, memory_bytes=64 << 20), identity)
    SessionWriter(client, "long").sync([*prompt, want[0]], state.caches, range(state.max_pages), PROMPT_LEN,
                                       tail=True)
    return client


def adopted(model, resident, budget_pages: int = 12, per_head: bool = True) -> tuple[ResidentSession, int]:
    """The resident session stored as "long" (`stored_session`) and adopted on the CPU by a fresh
    sparse-resident session → (session, tokens covered)."""
    prompt, state, want = resident
    client = stored_session(model, prompt, state, want)
    return ResidentSession.adopt(client, client.get_session("long"), model.config, budget_pages=budget_pages,
                                 max_pages=state.max_pages, device=torch.device("cpu"), dtype=torch.float32,
                                 per_head=per_head)


def speculation_budget(config) -> int:
    """The smallest budget with room for a step run again after repairs (`can_speculate`)."""
    return max(2, config.n_local + 1) + (config.num_layers + 2) * config.top_k


@pytest.mark.parametrize("per_head", [False, True])
def test_offloaded_session_decodes_identical_tokens_with_a_small_working_set(model, resident, per_head):
    """Per head (`per_head`), each KV head keeps its own columns of the slots, filled from its
    column of the host tier's pages, and attends over them as a one-head sequence."""
    _, state, want = resident
    max_pages = state.max_pages
    session = ResidentSession.offload(model.config, state.caches, PROMPT_LEN, budget_pages=10,
                                      max_pages=max_pages, per_head=per_head)
    assert session.caches[0].k_cache.shape[0] == 10 and session.caches[0].index_cache.shape[0] == max_pages
    # Every page is in the host tier from the offload on: the first step already needs no host sync
    # (was True until the first decode_metadata: tests/gpu/test_gpu_residency.py failed on the H200).
    assert not session.synced_steps
    assert decode(model, session, want[0], PROMPT_LEN, STEPS) == want
    stats = session.stats
    assert not session.synced_steps  # the host tier holds every page: no step went through the host
    assert stats.pages_fetched > STEPS  # pages really came in from the host tier...
    assert stats.evictions > 0  # ...and went out again
    assert stats.pages_written_back == model.config.num_layers  # page 37 filled at position 608
    for row in range(session.working.num_layers):  # per head: a row per (layer, KV head)
        assert len(session.working.resident_pages(row)) <= 10
    if per_head:  # a fetch moves one head's column: 1/Hkv of a page
        column = session.host.page_bytes // model.config.num_kv_heads
        assert stats.bytes_fetched == stats.pages_fetched * column


def test_budget_below_one_selection_is_refused(model, resident):
    _, state, _ = resident
    with pytest.raises(ValueError, match="budget_pages=9 is invalid"):
        ResidentSession.offload(model.config, state.caches, PROMPT_LEN, budget_pages=9,
                                max_pages=state.max_pages)


def test_adopted_session_fetches_selected_pages_first_and_decodes_identical_tokens(model, resident):
    prompt, state, want = resident
    client = stored_session(model, prompt, state, want)
    record = client.get_session("long")
    session, covered = ResidentSession.adopt(client, record, model.config, budget_pages=12,
                                             max_pages=state.max_pages, device=torch.device("cpu"),
                                             dtype=torch.float32)
    assert covered == PROMPT_LEN
    assert decode(model, session, want[0], PROMPT_LEN, STEPS, prefetch_items=8) == want
    host = session.host
    assert not host.present.all()  # the service was never copied whole
    # Service reads follow the selection: the first is what step 1's first layer selected (beyond
    # the tail page adoption loaded); background reads come after, predicted pages first, then the
    # newest pages: never page order.
    first_fetch = session.stats.fetch_log[0]
    assert first_fetch[:2] == (1, 0)
    assert host.service_log[0] == ("demand", [(p, 0) for p in first_fetch[2]])
    for kind, items in host.service_log:
        if kind == "prefetch":
            predicted_or_newest = [p for p, _ in items]
            assert predicted_or_newest != sorted(predicted_or_newest) or len(items) == 1
    assert any(kind == "prefetch" for kind, _ in host.service_log)


def test_working_set_keeps_the_write_ring_and_recently_selected_pages():
    working = WorkingSet(num_slots=6, ring=2)
    assert working.place_write_page(10) == (0, -1)
    assert working.admit([1, 2, 3, 4], step=1) == [(1, 2), (2, 3), (3, 4), (4, 5)]
    working.admit([3, 4], step=2)
    # Page 5 takes the slot of the least recently selected page (1 or 2, both step 1: the lower slot).
    assert working.admit([3, 5], step=3) == [(5, 2)]
    assert working.resident_pages() == [2, 3, 4, 5, 10]
    assert working.evictions == 1
    assert working.place_write_page(11) == (1, -1)  # the next write page: the ring's other slot
    assert working.place_write_page(12) == (0, 10)  # page 10 leaves the ring (written back before)
    with pytest.raises(ResidencyBudgetError, match="selected 5 pages"):
        working.admit([20, 21, 22, 23, 24], step=4)


@pytest.mark.parametrize("per_head", [False, True])
def test_adopted_session_filled_in_the_background_stops_syncing_and_keeps_the_tokens(model, resident,
                                                                                       per_head):
    """With a prefetch window over every stored page, the worker thread fills the host tier; from
    the step it holds every page on, the misses are admitted and copied with no host round trip."""
    _, _, want = resident
    session, _ = adopted(model, resident, per_head=per_head)
    session.prefetch(10_000)
    session.host.wait_all()
    assert decode(model, session, want[0], PROMPT_LEN, STEPS, prefetch_items=10_000) == want
    assert not session.synced_steps
    assert session.stats.host_steps == 0 and session.stats.pages_fetched > STEPS
    assert all(kind == "prefetch" for kind, _ in session.host.service_log)


@pytest.mark.parametrize("per_head", [False, True])
def test_without_a_host_view_the_host_reads_the_misses_and_the_tokens_stay(model, resident, per_head):
    """The fallback where no UVA view of the pinned tier can be made (on CUDA): each layer's
    misses are read on the host (one sync) and copied page by page (per head, column by column)."""
    _, state, want = resident
    session = ResidentSession.offload(model.config, state.caches, PROMPT_LEN, budget_pages=10,
                                      max_pages=state.max_pages, per_head=per_head)
    session._host_src = None
    assert session.synced_steps
    assert decode(model, session, want[0], PROMPT_LEN, STEPS) == want
    assert session.stats.host_steps == STEPS * model.config.num_layers
    assert len(session.stats.fetch_log) > 0 and session.stats.pages_fetched > STEPS


def test_host_tier_refuses_a_service_whose_pages_are_not_its_pages(model):
    """Service reads copy raw bytes into the host tier: a source in another dtype (same page size
    in bytes would otherwise be read as garbage) or page shape is refused up front."""
    from msaserve.engine.kv.host_tier import HostKV, ServiceSource

    def source(dtype: torch.dtype) -> ServiceSource:
        identity = identity_for(model.config, "tiny@seed0", dtype)
        return ServiceSource(KVCacheClient.in_process(ServiceConfig(num_shards=1, memory_bytes=1 << 20),
                                                      identity), [], "s")

    c = model.config
    page = (c.page_size, c.num_kv_heads, c.head_dim)
    with pytest.raises(ValueError, match=r"K/V pages of .* are \(16, 2, 16\) bfloat16: allowed only this "
                                         r"host tier's page \(16, 2, 16\) float16"):
        HostKV(c.num_layers, 8, page, torch.float16, pin=False, source=source(torch.bfloat16))
    host = HostKV(c.num_layers, 8, page, torch.bfloat16, pin=False, source=source(torch.bfloat16))
    with pytest.raises(ValueError, match=r"allowed only this host tier's page \(16, 2, 16\) bfloat16"):
        host.reset(source(torch.float32))


def test_background_read_of_the_stored_tail_never_overwrites_its_write_back(model, resident):
    """The race of issue 30: a background service read of the stored (partial) tail page, still in
    flight when the session fills that page and writes it back to the host tier, landed after the
    write-back and replaced the full page with the service's partial one. The interleaving is forced:
    the read of the tail page waits until the write-back is done."""
    import threading

    from msaserve.engine.kv.host_tier import ServiceSource

    _, _, want = resident
    session, covered = adopted(model, resident)
    tail = covered // model.config.page_size  # the partial page the session writes into next
    host, written_back = session.host, threading.Event()
    written: dict[int, torch.Tensor] = {}

    class HeldSource(ServiceSource):
        def read_into(self, items, dest, rows):
            if any(page == tail for page, _ in items):
                written_back.wait(timeout=5)  # in flight across the write-back
            return super().read_into(items, dest, rows)

    host.source = HeldSource(**vars(host.source))
    write = host.write

    def recording_write(layer, pages, kv):
        write(layer, pages, kv)
        if list(pages) == [tail]:
            written[layer] = kv[0].clone()
            if len(written) == model.config.num_layers:
                written_back.set()

    host.write = recording_write
    host.prefetch([(tail, 0)], max_items=1)  # a background read of the tail page, held in flight
    steps = (tail + 1) * model.config.page_size - PROMPT_LEN + 1  # past the tail page's last token
    assert decode(model, session, want[0], PROMPT_LEN, steps) == want[: steps + 1]
    written_back.set()
    host.wait_all()
    assert sorted(written) == list(range(model.config.num_layers))
    for layer, kv in written.items():
        assert torch.equal(host.data[layer, tail], kv), f"layer {layer}: the service's partial tail won"


def test_adoption_from_arena_pages_copied_directly_decodes_identical_tokens(model, resident):
    """The shards keep pages in arenas (pinned on CUDA; plain here): the index is copied from them
    directly and verified beside the copy (`direct_index.py`), and the tokens are the resident's."""
    _, state, want = resident
    client = leased_client(model, resident)
    session, covered = ResidentSession.adopt(client, client.get_session("long"), model.config,
                                             budget_pages=12, max_pages=state.max_pages,
                                             device=torch.device("cpu"), dtype=torch.float32)
    assert covered == PROMPT_LEN
    arenas = [shard.stores["index"].memory.arena for shard in client.shards]
    assert all(a.stats.slots_in_use > 0 and a.stats.retired_slots == 0 for a in arenas)
    # The index leases stay open through the first token: the session's second step starts their
    # releases (`release_ended_leases`) and its third waits for them. The K/V lease is held while
    # the session reads its pages in place.
    assert all("index" in shard.open_lease_stores() for shard in client.shards)
    assert decode(model, session, want[0], PROMPT_LEN, STEPS, prefetch_items=8) == want
    assert all(shard.open_lease_stores() == ["kv"] for shard in client.shards)
    assert session.host.service_reads == 0
    # A reused host tier ends it; the shards hear of it from the next session's second step on (off
    # its first token; the release started at one step is waited for at the next), here by hand.
    session.host.reset(None)
    assert session.host.lease is None and all(shard.open_lease_stores() for shard in client.shards)
    session.host.release_ended_leases()  # started
    session.host.release_ended_leases()  # waited for
    assert all(not shard.open_lease_stores() for shard in client.shards)
    session.host.release_ended_leases(wait=True)  # nothing left: a no-op


def test_a_corrupt_index_page_in_the_arena_ends_the_adoption_at_that_page(model, resident):
    from msaserve.kvcache.arena import numpy_segment
    from msaserve.kvcache.keys import index_key, shard_of_page

    prompt, state, want = resident
    identity = identity_for(model.config, "tiny@seed0", torch.float32)
    client = KVCacheClient.in_process(ServiceConfig(num_shards=2, memory_bytes=64 << 20), identity,
                                      segment_allocators={"index": numpy_segment})
    SessionWriter(client, "long").sync([*prompt, want[0]], state.caches, range(state.max_pages), PROMPT_LEN,
                                       tail=True)
    record = client.get_session("long")
    bad = 20
    shard = client.shards[shard_of_page(record.page_hashes[bad], 2)]
    shard.stores["index"].memory.get(index_key(client.model_key, record.page_hashes[bad])).payload[5] ^= 4
    session, covered = ResidentSession.adopt(client, record, model.config, budget_pages=12,
                                             max_pages=state.max_pages, device=torch.device("cpu"),
                                             dtype=torch.float32)
    assert covered == bad * model.config.page_size  # the caller recomputes from page 20 on
    session.host.release_ended_leases(wait=True)  # the index leases' releases began at the stop, in
    # the shards' threads: the shard has heard of the bad page once they are done (a clean-clone run
    # read the count before, 22900d7)
    assert shard.stats()["index"]["corruptions"] == 1
    assert session.host.source.readable == bad


@pytest.mark.parametrize("per_head", [False, True])
def test_an_adopted_session_decodes_through_the_graph_stepper_from_its_first_token(model, resident, per_head):
    """`SparseDecodeGraph` on an adopted session: its first steps go through the host (eagerly, on
    the plain path) while the host tier fills; once it holds every page the steps are sync-free
    (on CUDA: replayed). The tokens are the fully resident ones throughout."""
    _, _, want = resident
    session, covered = adopted(model, resident, per_head=per_head)
    assert covered == PROMPT_LEN and session.synced_steps
    stepper = SparseDecodeGraph(session, model, get_ops("msa", "cpu"))
    got = [want[0]]
    for step in range(STEPS):
        got.append(stepper.step(got[-1], PROMPT_LEN + step))
        session.prefetch(10_000)
        if step == 1:
            session.host.wait_all()
    assert got == want
    assert stepper.host_steps >= 1 and stepper.steps >= STEPS - 2 and not session.synced_steps


def test_reusing_a_host_tier_cancels_the_last_sessions_queued_reads(model, resident):
    """A replica reuses its pinned host tier for the next adoption: the last session's background
    reads still queued are dropped (not run to the end before the new session may start); the one
    already running is waited for, since it writes into that memory."""
    import threading

    from msaserve.engine.kv.host_tier import ServiceSource

    session, _ = adopted(model, resident)
    host, started, release = session.host, threading.Event(), threading.Event()
    reads: list[list[tuple[int, int]]] = []

    class HeldSource(ServiceSource):
        def read_into(self, items, dest, rows):
            reads.append(list(items))
            started.set()
            release.wait(timeout=5)
            return super().read_into(items, dest, rows)

    host.source = HeldSource(**vars(host.source))
    assert host.prefetch([], max_items=64, chunk=4) > 8  # many reads queued on the one worker
    assert started.wait(timeout=5)
    threading.Timer(0.2, release.set).start()  # the running read ends a little later
    host.reset(None)
    assert len(reads) == 1, "reset ran the queued reads of the session that left"
    assert not host.present.any() and host.poll() == 0


def test_a_demand_read_never_waits_behind_queued_background_reads(model, resident):
    """The stall found on 2026-12-04: a page a step needs, queued for a background read behind the
    rest of an adopted session's prefetch, made the step wait for that whole queue (one worker runs
    it in order: seconds at 1M tokens). Now it is read on demand while the queue waits; only a
    read already running would be waited for. Forced: the first background read is held in flight."""
    import threading

    from msaserve.engine.kv.host_tier import ServiceSource

    session, _ = adopted(model, resident)
    host, started, release = session.host, threading.Event(), threading.Event()

    class HeldSource(ServiceSource):
        def read_into(self, items, dest, rows):
            if threading.current_thread().name.startswith("host-tier-fill") and not started.is_set():
                started.set()
                release.wait(timeout=10)
            return super().read_into(items, dest, rows)

    host.source = HeldSource(**vars(host.source))
    assert host.prefetch([], max_items=64, chunk=4) > 8
    assert started.wait(timeout=5)
    queued = [item for _, items in host._pending for item in items]
    first, _ = host._pending[0]
    page, layer = host._pending[-1][1][0]  # queued last, behind the held read
    host.ensure(layer, [page])
    assert bool(host.present[layer, page]) and not first.done(), "the demand read waited for the queue"
    release.set()
    host.wait_all()
    assert all(bool(host.present[layer, page]) for page, layer in queued)


def test_residency_benchmark_runs_and_reports_the_adoptions_mean(tmp_path):
    """benchmarks/kvcache/residency.py at CPU sizes (its smoke run, with --thread-watch): every key
    written, tokens equal, the adopted TPOT key the mean over the first tokens with the slowest step
    and the second token."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "kv.json"
    command = [sys.executable, str(root / "benchmarks" / "kvcache" / "residency.py"), "--device", "cpu",
               "--quick", "--steps", "8", "--adopt-steps", "16", "--adoptions", "2", "--budgets", "0.1",
               "--thread-watch", "--output", str(out)]
    run = subprocess.run(command, check=True, cwd=root, capture_output=True, text=True, timeout=600)
    # --thread-watch (the next GPU run's first diagnostic) logs each adoption's threads and collections
    assert run.stdout.count("threads during the adoption:") >= 4
    results = json.loads(out.read_text())
    penalty = "kvcache.sparse_residency_tpot_penalty_10pct"
    for key in ("kvcache.adopt_vs_reprefill", "kvcache.lazy_tpot_penalty", "kvcache.lazy_tpot_penalty_eager",
                "kvcache.lazy_tpot_penalty_filled", "kvcache.lazy_tpot_penalty_host_steps",
                penalty, f"{penalty}_per_page", f"{penalty}_eager"):
        assert results[key]["value"] > 0, key
    lazy = results["kvcache.lazy_tpot_penalty"]
    assert "mean over the first tokens" in lazy["unit"] and "second token" in lazy["note"]
    assert "tokens equal: True" in lazy["note"] and "over 2 runs" in lazy["note"]
    assert "leased in place" in lazy["note"] and "0 steps through the host, 0 runs again" in lazy["note"]
    assert "tokens equal: True" in results["kvcache.lazy_tpot_penalty_filled"]["note"]
    warm = results["kvcache.adopt_vs_reprefill_warm"]
    assert warm["value"] > 0 and "tokens equal: True" in warm["note"]
    assert "first step replayed in 0 of 2 runs" in warm["note"]  # (no CUDA graphs on the CPU)
    assert "tokens equal: True" in results["kvcache.lazy_tpot_penalty_warm"]["note"]


def test_kv_lease_profile_runs_and_leases_every_item(tmp_path):
    """benchmarks/kvcache/profile_kv_lease.py at a small size: both keys written (it refuses to
    report a lease that did not cover every item)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "lease.json"
    script = root / "benchmarks" / "kvcache" / "profile_kv_lease.py"
    subprocess.run([sys.executable, str(script), "--pages", "64", "--layers", "2", "--shards", "2",
                    "--repeats", "1", "--output", str(out)], check=True, cwd=root, capture_output=True,
                   timeout=300)
    results = json.loads(out.read_text())
    assert results["kvcache.kv_lease_cpu_ms"]["value"] > 0
    assert "128 items" in results["kvcache.kv_lease_one_shard_cpu_us_per_item"]["workload"]


@pytest.mark.parametrize("prefetch_items", [0, 64])
def test_adopted_session_decodes_on_the_device_while_its_host_tier_fills(model, resident, prefetch_items):
    """The graph step of an adopted session (here its body, run eagerly as on the CPU) never goes
    through the host: pages a step selects that are not in the host tier yet are skipped on the
    device, read in by `repair` after the step, and the step runs again — the fully resident tokens,
    from the first token on. With no background reads at all, every page comes that way."""
    _, _, want = resident
    session, covered = adopted(model, resident, speculation_budget(model.config))
    assert covered == PROMPT_LEN and session.can_speculate and session.synced_steps
    graphed = SparseDecodeGraph(session, model, get_ops("msa", "cpu"))
    got = [want[0]]
    with torch.inference_mode():
        for step in range(STEPS):
            if prefetch_items:
                session.prefetch(prefetch_items)
            got.append(graphed.step(got[-1], PROMPT_LEN + step))
    assert got == want
    assert graphed.host_steps == 0 and graphed.reruns == session.repairs > 0
    if not prefetch_items:
        assert all(kind == "demand" for kind, _ in session.host.service_log)


def test_a_budget_without_room_for_reruns_keeps_the_host_path(model, resident):
    _, _, want = resident
    session, _ = adopted(model, resident)
    assert not session.can_speculate
    graphed = SparseDecodeGraph(session, model, get_ops("msa", "cpu"))
    with torch.inference_mode():
        assert graphed.step(want[0], PROMPT_LEN) == want[1]
    assert graphed.host_steps == 1 and graphed.reruns == 0


def test_offloaded_session_graph_steps_see_written_back_pages(model):
    """An offloaded session's host tier is complete, so its device presence map is final after one
    copy; pages written back later are marked there as they are written, or a step selecting one
    after it left the write ring would skip it with no repair to follow. 120 steps: pages 37-44."""
    c, steps = model.config, 120
    prompt = torch.randint(3, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        state = SequenceState(model, PROMPT_LEN + steps + 1)
        want = [int(torch.argmax(model.compute_logits(state.prefill(prompt, chunk_size=128)[-1:])[0]))]
        budget = speculation_budget(c)
        session = ResidentSession.offload(c, state.caches, PROMPT_LEN, budget_pages=budget,
                                          max_pages=state.max_pages)
        for step in range(steps):
            hidden = state.forward([want[-1]], PROMPT_LEN + step, decode=True)
            want.append(int(torch.argmax(model.compute_logits(hidden)[0])))
        assert session.can_speculate and not session.synced_steps
        graphed = SparseDecodeGraph(session, model, get_ops("msa", "cpu"))
        got = [want[0]]
        for step in range(steps):
            got.append(graphed.step(got[-1], PROMPT_LEN + step))
    assert got == want and graphed.reruns == 0 and session.stats.pages_written_back > 0
    # every page before the write page is marked on the device, the written-back ones included
    # (random weights rarely select a page again once it left the ring, so the tokens alone would
    # not show a missing mark)
    assert session.write_page > 40 and bool(session._present_dev[:, : session.write_page].all())


def leased_client(model, resident) -> KVCacheClient:
    """The resident session stored as "long" in 2 in-process shards that keep K/V and index pages in
    arenas (pinned on CUDA; plain here): an adoption leases the K/V where it lies."""
    from msaserve.kvcache.arena import numpy_segment

    prompt, state, want = resident
    identity = identity_for(model.config, "tiny@seed0", torch.float32)
    client = KVCacheClient.in_process(ServiceConfig(num_shards=2, memory_bytes=64 << 20), identity,
                                      segment_allocators={"index": numpy_segment, "kv": numpy_segment})
    SessionWriter(client, "long").sync([*prompt, want[0]], state.caches, range(state.max_pages), PROMPT_LEN,
                                       tail=True)
    return client


def adopt_leased(model, resident, client, per_head: bool = True) -> ResidentSession:
    _, state, _ = resident
    session, covered = ResidentSession.adopt(client, client.get_session("long"), model.config,
                                             budget_pages=12, max_pages=state.max_pages,
                                             device=torch.device("cpu"), dtype=torch.float32,
                                             per_head=per_head)
    assert covered == PROMPT_LEN
    return session


def test_an_adoption_asks_for_its_kv_lease_before_it_releases_the_index_leases(model, resident):
    """Each shard answers in order: the adoption's K/V lease reaches every shard before the index
    leases' releases, which start only after the first token (at the session's second step,
    `release_ended_leases`); every index lease ends."""
    client = leased_client(model, resident)
    calls: list[tuple[int, str]] = []
    submit = client.transport.submit

    def recording(shard, method, *args):
        calls.append((client.shards.index(shard), method))
        return submit(shard, method, *args)

    client.transport.submit = recording
    session = adopt_leased(model, resident, client)
    assert all(method != "release_lease" for _, method in calls), calls  # none before the first token
    session.host.release_ended_leases()  # (the second step's call) starts the index releases
    for s in range(len(client.shards)):
        mine = [method for i, method in calls if i == s]
        assert "lease_index" in mine and "lease_kv" in mine and "release_lease" in mine, mine
        assert mine.index("lease_kv") < mine.index("release_lease"), mine
    session.host.release_ended_leases()  # (the third step's) waits for them
    assert all(shard.open_lease_stores() == ["kv"] for shard in client.shards)


@pytest.mark.parametrize("per_head", [False, True])
def test_an_adopted_session_reads_its_leased_kv_in_place_with_no_fill(model, resident, per_head):
    """Every stored page's K/V is leased where the shards keep it: the host tier is complete at
    once (no service read, no background fill, no step through the host), the miss fill reads the
    leased pages in place, each is checked against its stored checksum at its first copy, and the
    tokens are the resident ones."""
    _, state, want = resident
    client = leased_client(model, resident)
    session = adopt_leased(model, resident, client, per_head)
    host, stored = session.host, PROMPT_LEN // model.config.page_size
    assert host.leased[:, :stored].all() and not host.leased[:, stored:].any()
    assert not session.synced_steps and session.adopt_phases["lease_s"] >= 0
    parts = session.lease_phases  # the lease phase in parts, which add up to it
    assert set(parts) == {"request_s", "wait_s", "attach_s", "tables_s", "rest_s"}
    assert sum(parts.values()) == pytest.approx(session.adopt_phases["lease_s"], abs=1e-6)
    stepper = SparseDecodeGraph(session, model, get_ops("msa", "cpu"))
    got = [want[0]]
    for step in range(STEPS):
        got.append(stepper.step(got[-1], PROMPT_LEN + step))
    assert got == want
    assert stepper.host_steps == 0 and stepper.reruns == 0 and host.service_reads == 0
    checked = session._verified.bool() & torch.from_numpy(host.leased)
    assert int(checked.sum()) > 0 and not session._failures.any()
    # The leased bytes are the stored pages' bytes (the pages the session wrote back are its own).
    kv = torch.stack([torch.stack([c.k_cache, c.v_cache], 1) for c in state.caches])  # [L, pages, 2, ...]
    layer, page = 1, 3
    address = host.data.data_ptr() + int(host.byte_offsets[layer, page])
    assert address != host.data[layer, page].data_ptr()
    import ctypes

    raw = (ctypes.c_uint8 * host.page_bytes).from_address(address)
    assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.float32).view_as(kv[layer, page]),
                       kv[layer, page])


def test_a_corrupt_leased_page_voids_the_step_and_is_dropped_from_the_service(model, resident):
    """A leased page whose bytes no longer match its stored checksum: the step that copies it in
    hashes it, the step's token is refused (PageLostInService names the page and layer), the page
    is reported to its shard (dropped, counted as a corruption) and the lease ends."""
    from msaserve.engine.kv.host_tier import PageLostInService
    from msaserve.kvcache.keys import kv_key, shard_of_page

    _, _, want = resident
    client = leased_client(model, resident)
    record = client.get_session("long")
    shard = client.shards[shard_of_page(record.page_hashes[0], 2)]
    key = kv_key(client.model_key, record.page_hashes[0], 1)  # page 0 (an init page: always selected)
    shard.stores["kv"].memory.get(key).payload[7] ^= 16
    session = adopt_leased(model, resident, client)
    stepper = SparseDecodeGraph(session, model, get_ops("msa", "cpu"))
    with pytest.raises(PageLostInService, match=r"\(0, 1\)"):
        stepper.step(want[0], PROMPT_LEN)
    assert shard.stats()["kv"]["corruptions"] == 1
    assert session.host.lease is None and all(not s._leases for s in client.shards)


def test_a_leased_host_tier_renews_its_lease_and_an_expired_lease_is_an_error(model, resident):
    import time

    from msaserve.engine.kv.host_tier import RENEW_S, PageLostInService

    client = leased_client(model, resident)
    session = adopt_leased(model, resident, client)
    host = session.host
    ids = {shard_id: lease_id for shard_id, _, lease_id in host.lease._parts}
    before = {s: client.shards[s]._lease_started[i] for s, i in ids.items()}
    host.renew_lease(now=time.monotonic() + RENEW_S / 2)  # not due yet
    assert all(client.shards[s]._lease_started[i] == before[s] for s, i in ids.items())
    time.sleep(0.01)
    host.renew_lease(now=time.monotonic() + RENEW_S + 1)
    assert all(client.shards[s]._lease_started[i] > before[s] for s, i in ids.items())
    shard_id, lease_id = next(iter(ids.items()))
    client.shards[shard_id].release_lease(lease_id)  # as the shard does once lease_ttl_s passed
    with pytest.raises(PageLostInService, match="ended the lease"):
        host.renew_lease(now=time.monotonic() + 3 * RENEW_S)


def test_a_host_tier_never_writes_over_a_leased_page(model, resident):
    client = leased_client(model, resident)
    session = adopt_leased(model, resident, client)
    page = torch.zeros(1, *session.host.data.shape[2:])
    with pytest.raises(ValueError, match="leased from the service"):
        session.host.write(0, [2], page)


def test_the_garbage_collector_waits_until_an_adoption_is_done():
    from msaserve.engine.kv import resident_session

    seen = []
    with resident_session.gc_paused():
        seen.append(gc.isenabled())
        with resident_session.gc_paused():  # nested: still paused inside, and after the inner one
            seen.append(gc.isenabled())
        seen.append(gc.isenabled())
    assert seen == [False, False, False] and gc.isenabled()


def test_an_adoption_runs_with_the_garbage_collector_paused(model, resident, monkeypatch):
    from msaserve.engine.kv import resident_session

    seen = []
    original = resident_session.LazyPageFetcher.load_index

    def load_index(self):
        seen.append(gc.isenabled())
        return original(self)

    monkeypatch.setattr(resident_session.LazyPageFetcher, "load_index", load_index)
    _, state, _ = resident
    client = leased_client(model, resident)
    ResidentSession.adopt(client, client.get_session("long"), model.config, budget_pages=12,
                          max_pages=state.max_pages, device=torch.device("cpu"), dtype=torch.float32)
    assert seen == [False] and gc.isenabled()


# ---- the next session in an ended one's memory (adopt(into=), offload(into=)) ----------------------
class ReadsBefore(TorchDispatchMode):
    """The storages a stretch of code reads that existed before it (`before`: their addresses):
    what a CUDA graph captured from such a step would read by address."""

    def __init__(self, before: set[int]) -> None:
        super().__init__()
        self.before, self.read = before, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_leaves((args, kwargs or {})):
            if isinstance(t, torch.Tensor):
                address = t.untyped_storage().data_ptr()
                if address in self.before:
                    self.read.add(address)
        return func(*args, **(kwargs or {}))


def live_storages() -> set[int]:
    gc.collect()
    with warnings.catch_warnings():  # (isinstance on a deprecated torch alias warns)
        warnings.simplefilter("ignore")
        return {o.untyped_storage().data_ptr() for o in gc.get_objects()
                if isinstance(o, torch.Tensor) and o.device.type == "cpu" and not o.is_meta}


def store_other(client: KVCacheClient, other) -> None:
    prompt, state, want = other
    SessionWriter(client, "other").sync([*prompt, want[0]], state.caches, range(state.max_pages), PROMPT_LEN,
                                        tail=True)


def traced_step(stepper: SparseDecodeGraph, token: int, position: int) -> tuple[int, set[int]]:
    """One step → (its token, the storages it read that existed before it)."""
    mode = ReadsBefore(live_storages())
    with mode:
        token = stepper.step(token, position)
    return token, mode.read


def stepped(stepper: SparseDecodeGraph, first_token: int, steps: int) -> list[int]:
    """Greedy decode through the stepper from PROMPT_LEN → the first token and the `steps` after it
    (an adopted session's host tier filled to the end after each step)."""
    tokens = [first_token]
    for step in range(steps):
        tokens.append(stepper.step(tokens[-1], PROMPT_LEN + step))
        stepper.session.host.wait_all()
    return tokens


def session_tensors(session: ResidentSession) -> list[int]:
    w = session.working
    tensors = [*session.pools, *(c.index_cache for c in session.caches), w.slot_of, w.page_in, w.last_used,
               w.counters, session.step_number, session.index_table]
    return [t.data_ptr() for t in tensors] + list(session.graph_inputs())


@pytest.mark.parametrize("per_head", [False, True])
def test_a_session_adopted_into_an_ended_one_keeps_its_memory_its_graph_and_the_tokens(model, resident,
                                                                                        other, per_head):
    """`adopt(into=)`: another session adopted into the first one's device tensors (same addresses),
    the first one's `SparseDecodeGraph` steps it from its first token on without a warm-up (on CUDA
    its captured graph replays), its first step reads no tensor the first session's captured step
    did not, and each session's tokens are its fully resident ones."""
    _, _, want = resident
    client = leased_client(model, resident)
    store_other(client, other)
    session = adopt_leased(model, resident, client, per_head)
    stepper = SparseDecodeGraph(session, model, get_ops("msa", "cpu"))
    got, captured_reads = [want[0]], set()
    for step in range(STEPS):
        if stepper.steps == WARMUP_STEPS:  # the step a CUDA graph captures
            token, captured_reads = traced_step(stepper, got[-1], PROMPT_LEN + step)
            got.append(token)
        else:
            got.append(stepper.step(got[-1], PROMPT_LEN + step))
    assert got == want and captured_reads
    addresses, captured, calls = session_tensors(session), stepper.captured, stepper.steps
    _, state, _ = resident
    again, covered = ResidentSession.adopt(client, client.get_session("other"), model.config, budget_pages=12,
                                           max_pages=state.max_pages, device=torch.device("cpu"),
                                           dtype=torch.float32, per_head=per_head, into=session)
    assert again is session and covered == PROMPT_LEN and session.generation == 1
    want = other[2]
    assert want[:8] != resident[2][:8]
    assert session_tensors(session) == addresses
    assert session.stats.steps == 0 and session.write_page == PROMPT_LEN // model.config.page_size
    host = session.host
    assert torch.equal(session._verified.bool(), torch.from_numpy(~host.leased))  # every lease unchecked
    token, reads = traced_step(stepper, want[0], PROMPT_LEN)
    assert stepper.captured is captured and stepper.steps == calls + 1  # past the warm-up: a replay
    assert reads <= captured_reads, "the step reads memory the captured step did not"
    got = [want[0], token]
    for step in range(1, STEPS):
        got.append(stepper.step(got[-1], PROMPT_LEN + step))
    assert got == want and stepper.host_steps == 0 and stepper.captures == 0
    assert session.stats.steps == STEPS
    session.host.release_ended_leases(wait=True)
    session.check_pages()
    assert not session._failures.any()


def test_a_session_is_refused_a_session_of_other_settings_naming_the_field(model, resident):
    _, state, _ = resident
    client = leased_client(model, resident)
    session = adopt_leased(model, resident, client)
    for change, field in ((dict(budget_pages=14), "budget_pages=14"),
                          (dict(per_head=False), "per_head=False"),
                          (dict(max_pages=state.max_pages + 1), f"max_pages={state.max_pages + 1}")):
        settings = dict(budget_pages=12, max_pages=state.max_pages, per_head=True) | change
        with pytest.raises(ValueError, match=f"into: .*{field}"):
            ResidentSession.adopt(client, client.get_session("long"), model.config,
                                  device=torch.device("cpu"), dtype=torch.float32, into=session, **settings)
    other = adopted(model, resident)[0].host
    with pytest.raises(ValueError, match=r"into: .*host is another host tier"):
        ResidentSession.adopt(client, client.get_session("long"), model.config, budget_pages=12,
                              max_pages=state.max_pages, device=torch.device("cpu"), dtype=torch.float32,
                              host=other, into=session)


def test_an_offload_into_a_leased_session_and_an_adoption_into_an_offloaded_one_keep_the_tokens(
        model, resident, other):
    """An offloaded session in an adopted one's memory keeps its lease tables (a captured step reads
    them), now naming every page's own row of the host tier, each counted as checked; an adoption
    without a lease into an offloaded session has no tables: its graph is captured again."""
    _, state, want = resident
    client = leased_client(model, resident)
    store_other(client, other)
    session, _ = ResidentSession.adopt(client, client.get_session("other"), model.config, budget_pages=12,
                                       max_pages=state.max_pages, device=torch.device("cpu"),
                                       dtype=torch.float32)
    stepper = SparseDecodeGraph(session, model, get_ops("msa", "cpu"))
    assert stepped(stepper, other[2][0], 4) == other[2][:5]
    inputs = session.graph_inputs()
    again = ResidentSession.offload(model.config, state.caches, PROMPT_LEN, 12, state.max_pages, into=session)
    assert again is session and session.graph_inputs() == inputs
    assert bool(session._verified.all()) and not session.host.leased.any()
    own = torch.arange(session._elem_offsets.numel()).view_as(session._elem_offsets) * (
        session.host.page_bytes // session.host.data.element_size())
    assert torch.equal(session._elem_offsets, own)
    assert stepped(stepper, want[0], STEPS) == want and stepper.captures == 0
    # a session adopted without a lease (pages read from the service), then a leased one in its memory
    plain = stored_session(model, *other)
    first, _ = ResidentSession.adopt(plain, plain.get_session("long"), model.config, budget_pages=12,
                                     max_pages=state.max_pages, device=torch.device("cpu"),
                                     dtype=torch.float32)
    stepper = SparseDecodeGraph(first, model, get_ops("msa", "cpu"))
    assert stepped(stepper, other[2][0], 4) == other[2][:5]
    old = stepper.captured
    second, _ = ResidentSession.adopt(client, client.get_session("long"), model.config, budget_pages=12,
                                      max_pages=state.max_pages, device=torch.device("cpu"),
                                      dtype=torch.float32, into=first)
    assert second.graph_inputs() != stepper._inputs  # leased now: the tables exist
    assert stepped(stepper, want[0], STEPS) == want and stepper.captured is not old


@pytest.mark.parametrize("into", [False, True])
def test_adoption_profile_runs_and_checks_the_slots(tmp_path, into):
    """benchmarks/kvcache/profile_adoption.py at a small size, adoptions by new session objects and
    into the last one's: the first step's slots hold the stored pages' K/V (its own check)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "profile.json"
    command = [sys.executable, str(root / "benchmarks" / "kvcache" / "profile_adoption.py"), "--pages", "64",
               "--repeats", "2", "--output", str(out), *(["--into"] if into else [])]
    run = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600, check=True)
    assert "first step's slots equal to the stored pages: True" in run.stdout
    suffix = "cpu_into" if into else "cpu"
    assert json.loads(out.read_text())[f"kvcache.adopt_first_step_residency_ms_{suffix}"]["value"] > 0
