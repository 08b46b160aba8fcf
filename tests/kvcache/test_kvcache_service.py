"""The sharded Ray service on a real local Ray: round trips, routing, restarts, shared prefixes."""

import itertools
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
import xxhash
from reference_decode import SequenceState, generate, step_metadata

from msaserve.engine.config import EngineConfig
from msaserve.engine.kv import adoption
from msaserve.engine.kv.adoption import LazyPageFetcher, PageLost, forward_with_ops
from msaserve.engine.kv.pages import identity_for
from msaserve.engine.kv.persist import SessionWriter
from msaserve.engine.kv.prefix import PrefixPageIO
from msaserve.engine.kv.service_swap import ServiceSwapStore
from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.types import GenerateRequest, SamplingParams
from msaserve.kernels import get_ops
from msaserve.kvcache.client import KVCacheClient, ServiceUnavailable, start_shards
from msaserve.kvcache.config import ServiceConfig
from msaserve.kvcache.keys import IncompatibleModel, ModelIdentity, index_key, kv_key, shard_of_page
from msaserve.kvcache.page_hash import page_hashes
from msaserve.kvcache.session_records import SessionNotFound, SessionRecord
from msaserve.models.presets import get_preset
from msaserve.models.transformer import MSATransformer, init_random_weights

MODEL = ModelIdentity("tiny@test", num_layers=2, page_size=4, num_kv_heads=2, head_dim=8,
                      num_index_heads=1, index_dim=8, kv_dtype="float32", index_dtype="float32")
_names = itertools.count()


@pytest.fixture(scope="module")
def ray_cluster():
    # Workers import the test helpers (reference_decode) from tests/, as the driver does.
    tests_dir = str(Path(__file__).resolve().parents[1])
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False,
             _node_ip_address="127.0.0.1", namespace="msaserve-kvcache-test",
             runtime_env={"env_vars": {"PYTHONPATH": tests_dir}})
    yield
    ray.shutdown()


@pytest.fixture
def service(ray_cluster, tmp_path):
    """Starts shards (with a disk tier under tmp_path) and kills them afterwards."""
    started = []

    def start(num_shards=3, memory_bytes=1 << 20, disk=True, prefix=None):
        config = ServiceConfig(
            num_shards=num_shards, memory_bytes=memory_bytes, disk_path=str(tmp_path) if disk else None,
            disk_bytes=8 << 20 if disk else 0, actor_name_prefix=prefix or f"kv{next(_names)}",
        )
        shards = start_shards(config)
        started.extend(shards)
        return config, shards

    yield start
    for shard in started:
        ray.kill(shard)


@pytest.fixture(scope="module")
def shared(ray_cluster, tmp_path_factory):
    """One 3-shard service with a disk tier for the tests that need no restart (actors are slow to
    start on a loaded 2-core machine). Tests use disjoint page hashes and session ids."""
    config = ServiceConfig(num_shards=3, memory_bytes=8 << 20, disk_path=str(tmp_path_factory.mktemp("kv")),
                           disk_bytes=32 << 20, actor_name_prefix="shared")
    shards = start_shards(config)
    yield config, shards
    for shard in shards:
        ray.kill(shard)


def kv(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, 2 * 4 * 2 * 8 * 4, dtype=np.uint8)


def index(seed: int) -> np.ndarray:
    return np.random.default_rng(seed + 10_000).integers(0, 256, 2 * 4 * 8 * 4, dtype=np.uint8)


def upload(client: KVCacheClient, hashes: list[int]) -> None:
    client.put_pages([(h, [kv(h * 2 + layer) for layer in range(2)], index(h)) for h in hashes])


def test_round_trip_and_shard_routing(shared):
    _, shards = shared
    client = KVCacheClient(shards, MODEL)
    hashes = [3 * i + r for i in range(4) for r in range(3)] + [(1 << 64) - 1]
    upload(client, hashes)
    got = client.get_kv([(h, layer) for h in hashes for layer in range(2)])
    for (h, layer), payload in zip([(h, layer) for h in hashes for layer in range(2)], got, strict=True):
        np.testing.assert_array_equal(payload, kv(h * 2 + layer))
    for h, payload in zip(hashes, client.get_index(hashes), strict=True):
        np.testing.assert_array_equal(payload, index(h))
    assert client.get_kv([(999, 0)]) == [None]
    assert client.has_pages([hashes[0], 999]) == [True, False]
    # packed reads through Ray: each shard's rows come back as one array, placed by the client
    asked = [*hashes, 999]
    out = np.zeros((len(asked), index(0).nbytes), dtype=np.uint8)
    fetch = client.get_index_packed_async(asked, out)
    assert fetch.result() == [True] * len(hashes) + [False]
    for item, h in enumerate(hashes):
        np.testing.assert_array_equal(out[fetch.rows[item]], index(h))
    for shard in range(3):  # each page lives on exactly hash % num_shards
        only = KVCacheClient([shards[shard]], MODEL)  # asks this one shard alone
        for h in hashes:
            assert only.has_pages([h]) == [shard_of_page(h, 3) == shard]


def test_an_engine_process_leases_index_pages_from_shard_actors_in_place(ray_cluster, tmp_path):
    """Shard actors keep their index arenas in shared-memory files (`shared_index_arena`, as the
    platform starts them): this process maps them and reads the leased pages in place, through Ray
    only for the lease's where-is-it answer and its end."""
    config = ServiceConfig(num_shards=2, memory_bytes=8 << 20, actor_name_prefix=f"arena{next(_names)}",
                           shared_index_arena=True, shared_directory=str(tmp_path))
    shards = start_shards(config)
    try:
        client = KVCacheClient(shards, MODEL)
        assert client.arena_stores() == {"index"}
        hashes = [7000 + i for i in range(12)]
        upload(client, hashes)
        lease = client.lease_index_async([*hashes, 999]).result()
        assert (lease.segment_of[:-1] >= 0).all() and lease.views[-1] is None
        for i, h in enumerate(hashes):
            np.testing.assert_array_equal(lease.views[i], index(h))
        assert any(p.name.startswith("msaserve-") for p in tmp_path.iterdir())  # the arenas' files
        assert sum(ray.get([a.stats.remote() for a in shards])[i]["open_leases"] for i in range(2)) == 2
        lease.release()
        assert all(stats["open_leases"] == 0 for stats in ray.get([a.stats.remote() for a in shards]))
    finally:
        for shard in shards:
            ray.kill(shard)


def test_two_clients_share_a_prefix_page_by_hash(shared):
    config, shards = shared
    replica_a = KVCacheClient(shards, MODEL)
    replica_b = KVCacheClient.connect(config, MODEL)  # another replica finds the shards by name
    upload(replica_a, [41, 42])
    assert replica_b.has_pages([41, 42]) == [True, True]
    np.testing.assert_array_equal(replica_b.get_kv([(42, 1)])[0], kv(42 * 2 + 1))
    other_model = KVCacheClient(shards, ModelIdentity(**{**MODEL.as_dict(), "name": "other"}))
    assert other_model.has_pages([41]) == [False]  # same tokens, another model: not shared


def test_sessions_survive_a_service_restart_with_the_disk_tier(service):
    _, shards = service(num_shards=2, prefix="restart")
    client = KVCacheClient(shards, MODEL)
    upload(client, [7, 8])
    client.put_session(SessionRecord("chat-1", MODEL, token_ids=list(range(9)), page_hashes=[7, 8],
                                     sampling_state={"temperature": 0.0}, pinned=True))
    client.append_session("chat-1", [9, 10], [], {"temperature": 0.0, "generated": 2})
    for shard in shards:
        ray.kill(shard)
    _, restarted = service(num_shards=2, prefix="restart2")  # new actors, same disk path
    client = KVCacheClient(restarted, MODEL)
    record = client.get_session("chat-1")
    assert record.token_ids == list(range(11)) and record.page_hashes == [7, 8] and record.pinned
    assert record.sampling_state["generated"] == 2
    assert client.restore_pins() == 1
    np.testing.assert_array_equal(client.get_kv([(8, 1)])[0], kv(17))
    assert client.list_sessions() == ["chat-1"]
    client.delete_session("chat-1")
    with pytest.raises(SessionNotFound):
        client.get_session("chat-1")


def test_incompatible_replica_refuses_a_session(shared):
    _, shards = shared
    KVCacheClient(shards, MODEL).put_session(SessionRecord("s", MODEL))
    other = ModelIdentity(**{**MODEL.as_dict(), "page_size": 8})
    with pytest.raises(IncompatibleModel, match="page_size"):
        KVCacheClient(shards, other).get_session("s")


def test_memory_cap_holds_under_load_through_the_service(service):
    _, shards = service(num_shards=1, memory_bytes=64 * 1024, disk=False)
    client = KVCacheClient(shards, MODEL)
    for start in range(0, 400, 40):
        upload(client, list(range(start, start + 40)))
        for s in client.stats():
            for store in ("kv", "index"):
                assert s[store]["memory_bytes"] <= s[store]["memory_capacity"]
    assert sum(s["kv"]["evictions_dropped"] for s in client.stats()) > 0
    # a dead shard is an error naming the service, not a hang (no_restart: a restarted shard
    # would answer "missing" instead, depending on how fast it comes back). ray.kill is
    # asynchronous: a call racing it may still be answered, so ask until the death is seen.
    ray.kill(shards[0], no_restart=True)
    deadline = time.monotonic() + 30
    with pytest.raises(ServiceUnavailable, match="did not answer"):
        while time.monotonic() < deadline:
            client.get_kv([(399, 0)])
            time.sleep(0.05)


# ---- a session moved between two replicas (the tiny model, real ops) ----------------------------
@pytest.fixture(scope="module")
def tiny():
    config = get_preset("tiny")
    model = init_random_weights(MSATransformer(config, attention_backend="naive"), seed=3)
    model.eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, config.vocab_size, (150,), generator=generator).tolist()
    return model, prompt, identity_for(config, "tiny@seed3", torch.float32)


def run_replica_a(
    client: KVCacheClient, model, prompt: list[int], num_new: int, capacity: int
) -> tuple[list[int], SequenceState]:
    """Generate num_new greedy tokens, persisting the session after every step, then 'die'."""
    state = SequenceState(model, capacity)
    writer = SessionWriter(client, "moved")
    tokens = list(prompt)
    with torch.inference_mode():
        hidden = state.prefill(prompt)[-1:]
        for _ in range(num_new):
            tokens.append(int(torch.argmax(model.compute_logits(hidden)[0])))
            writer.sync(tokens, state.caches, range(state.max_pages), len(tokens) - 1, {"temperature": 0.0},
                        tail=True)
            hidden = state.forward([tokens[-1]], len(tokens) - 1, decode=True)
    assert writer.bytes_uploaded > 0
    return tokens[len(prompt):], state


def run_replica_b(
    client: KVCacheClient, model, num_new: int, capacity: int, session_id: str = "moved"
) -> tuple[list[int], LazyPageFetcher]:
    """Adopt the session from the service (index first, K/V lazily) and generate num_new more.
    A lost page (corrupt or missing) falls back to recomputing from the token ids."""
    record = client.get_session(session_id)
    state = SequenceState(model, capacity)
    fetcher = LazyPageFetcher(client, record, state.caches, list(range(state.max_pages)))
    covered = fetcher.load_index()
    ops = fetcher.wrap_ops(get_ops("naive"))
    tokens = list(record.token_ids)
    page_size = model.config.page_size

    def forward(ids: list[int], start: int, decode: bool) -> torch.Tensor:
        meta = step_metadata(start, len(ids), state.max_pages, page_size, decode, torch.device("cpu"))
        return forward_with_ops(model, torch.tensor(ids), meta, state.caches, ops)[-1:]

    try:
        hidden = forward(tokens[covered:], covered, decode=False)  # the tail A had not stored
        fetcher.pages_for_first_token = fetcher.stats.kv_pages_on_demand
        out = []
        for _ in range(num_new):
            out.append(int(torch.argmax(model.compute_logits(hidden)[0])))
            tokens.append(out[-1])
            hidden = forward([out[-1]], len(tokens) - 1, decode=True)
    except PageLost:
        fetcher.num_pages = 0  # recompute everything from the token ids
        hidden, out = forward(list(record.token_ids), 0, decode=False), []
        tokens = list(record.token_ids)
        for _ in range(num_new):
            out.append(int(torch.argmax(model.compute_logits(hidden)[0])))
            tokens.append(out[-1])
            hidden = forward([out[-1]], len(tokens) - 1, decode=True)
    return out, fetcher


@pytest.mark.parametrize("corrupt,group_pages", [
    (None, adoption.INDEX_GROUP_PAGES), (None, 3), ("index", adoption.INDEX_GROUP_PAGES), ("index", 3),
    ("kv", adoption.INDEX_GROUP_PAGES),
])
def test_session_moved_mid_generation_gives_identical_greedy_tokens(
    service, shared, tiny, corrupt, group_pages, monkeypatch
):
    """group_pages 3: the index arrives in several pipelined reads (the bad page 4 in the second)."""
    monkeypatch.setattr(adoption, "INDEX_GROUP_PAGES", group_pages)
    model, prompt, identity = tiny
    reference = generate(model, prompt, 16)
    if corrupt is None:
        config, shards = shared
    else:  # a service of its own, to restart
        config, shards = service(num_shards=1, memory_bytes=8 << 20, prefix=f"move-{corrupt}-{group_pages}")
    client = KVCacheClient(shards, identity)
    client.delete_session("moved")  # the shared service may hold it from another case
    before, state_a = run_replica_a(client, model, prompt, 6, capacity=200)
    record = client.get_session("moved")
    assert len(record.token_ids) == 156 and len(record.page_hashes) == 155 // 16
    assert record.tail_tokens == 155 - 9 * 16 and record.num_stored_tokens == 155
    if corrupt is not None:  # restart (memory empty) and flip a byte in one page file on disk
        for shard in shards:
            ray.kill(shard)
        config, shards = service(num_shards=1, memory_bytes=8 << 20,
                                 prefix=f"move-{corrupt}-{group_pages}-restarted")
        client = KVCacheClient(shards, identity)
        victim = record.page_hashes[0 if corrupt == "kv" else 4]
        key = kv_key(identity.key, victim, 0) if corrupt == "kv" else index_key(identity.key, victim)
        name = xxhash.xxh3_128_hexdigest(key.encode()) + ".page"
        file = config.shard_dir(0) / corrupt / name
        raw = bytearray(file.read_bytes())
        raw[-1] ^= 0x40
        file.write_bytes(bytes(raw))
    after, fetcher = run_replica_b(client, model, 10, capacity=200)
    assert before + after == reference
    corruptions = sum(s["kv"]["corruptions"] + s["index"]["corruptions"] for s in client.stats())
    assert corruptions == (0 if corrupt is None else 1)
    if corrupt is None:  # the index came whole; K/V only for the selected pages of each layer
        assert fetcher.num_pages == 10 and fetcher.stats.index_bytes > 0  # 9 full pages + the tail
        # The first token needed at most Hkv × top_k = 8 of the 10 pages per layer.
        assert 0 < fetcher.pages_for_first_token <= 2 * 2 * 4 < 2 * 10
        # B's K/V of the token it ran first (slot 11 of the stored tail page 9) is its own, not
        # overwritten by the tail's stored copy (which A exported before running that token).
        for cache_a, cache_b in zip(state_a.caches, fetcher.caches, strict=True):
            for name in ("k_cache", "v_cache"):
                a, b = getattr(cache_a, name)[9, 11], getattr(cache_b, name)[9, 11]
                assert b.abs().sum() > 0 and torch.allclose(a, b, atol=1e-5), name
    if corrupt == "index":
        assert fetcher.num_pages == 4  # pages after the bad one were recomputed, not served


# ---- two replicas share a cached prefix through the service ------------------------------------
def test_two_replicas_share_a_cached_prefix_through_the_service(shared, tiny):
    model, _, identity = tiny
    _, shards = shared
    generator = torch.Generator().manual_seed(77)
    prefix = torch.randint(3, 512, (96,), generator=generator).tolist()  # 6 pages of 16
    first = prefix + torch.randint(3, 512, (21,), generator=generator).tolist()
    second = prefix + torch.randint(3, 512, (13,), generator=generator).tolist()
    want = generate(model, second, 8)

    replica_a = SequenceState(model, 160)  # computes `first`, then offloads its pages
    with torch.inference_mode():
        replica_a.prefill(first)
    hashes_a = page_hashes(first, 16)
    io_a = PrefixPageIO(KVCacheClient(shards, identity))
    assert io_a.store(hashes_a, replica_a.caches, range(len(hashes_a))) > 0
    assert io_a.store(hashes_a, replica_a.caches, range(len(hashes_a))) == 0  # already held

    io_b = PrefixPageIO(KVCacheClient(shards, identity))  # another replica, its own client
    hashes_b = page_hashes(second[: (len(second) - 1) // 16 * 16], 16)
    num_shared = io_b.held_prefix(hashes_b)
    assert num_shared == 6  # the 7th page differs
    replica_b = SequenceState(model, 160)
    assert io_b.load(hashes_b[:num_shared], replica_b.caches, range(num_shared)) == 6
    got = []
    with torch.inference_mode():
        hidden = replica_b.forward(second[96:], 96)[-1:]  # only the tokens after the shared pages
        for step in range(8):
            got.append(int(torch.argmax(model.compute_logits(hidden)[0])))
            hidden = replica_b.forward([got[-1]], len(second) + step, decode=True)
    assert got == want and io_b.bytes_loaded > 0


# ---- the engine's swap-based preemption through the service -----------------------------------
@pytest.mark.parametrize("memory_bytes", [8 << 20, 64 * 1024], ids=["swapped", "service-full"])
def test_engine_preemption_swaps_through_the_service_with_identical_tokens(service, tiny, memory_bytes):
    model, _, identity = tiny
    prompts = [torch.randint(3, 512, (80,), generator=torch.Generator().manual_seed(200 + i)).tolist()
               for i in range(4)]
    want = [generate(model, p, 12) for p in prompts]
    _, shards = service(num_shards=1, memory_bytes=memory_bytes, disk=False)
    store = ServiceSwapStore(KVCacheClient(shards, identity))
    # Four 80-token prompts fill 4 × 5 of the 21 pages; their first decode steps need a sixth page
    # each, so the newest sequences are preempted (swapped out to the service) and resumed.
    config = EngineConfig(model="tiny", num_pages=21, max_num_seqs=8, max_num_batched_tokens=400)
    engine = LLMEngine(config, model=model, page_store=store)
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerateRequest(f"r{i}", prompt, SamplingParams(max_tokens=12, temperature=0.0,
                                                                            ignore_eos=True)))
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.token_ids)
    assert engine.scheduler.num_preemptions > 0
    assert [outputs[f"r{i}"] for i in range(4)] == want
    assert len(store) == 0
    stats = KVCacheClient(shards, identity).stats()[0]
    if memory_bytes == 8 << 20:  # swapped out and back: pages written, read, then deleted
        assert store.bytes_stored > 0 and stats["kv"]["hits_memory"] > 0
    else:  # a swap of 5 pages × 2 layers × 4 KiB does not fit 56 KiB of K/V: recomputed instead
        assert store.bytes_stored == 0
    assert stats["kv"]["memory_pages"] == 0 and stats["index"]["memory_pages"] == 0


# ---- a replica killed mid-generation: its session resumes on another one ----------------------
def replica_task(shards, identity: ModelIdentity, prompt: list[int], max_new: int) -> None:
    """Replica A in its own worker process: the tiny model (same seed), persisting every step."""
    import time

    model = init_random_weights(MSATransformer(get_preset("tiny"), attention_backend="naive"), seed=3)
    model.eval().requires_grad_(False)
    writer = SessionWriter(KVCacheClient(shards, identity), "killed")
    state = SequenceState(model, len(prompt) + max_new + 1)
    tokens = list(prompt)
    with torch.inference_mode():
        hidden = state.prefill(prompt)[-1:]
        for _ in range(max_new):
            tokens.append(int(torch.argmax(model.compute_logits(hidden)[0])))
            writer.sync(tokens, state.caches, range(state.max_pages), len(tokens) - 1, tail=True)
            hidden = state.forward([tokens[-1]], len(tokens) - 1, decode=True)
            time.sleep(0.1)  # leaves the test time to kill it mid-generation


def test_killed_replica_session_resumes_on_another_with_identical_tokens(shared, tiny):
    import time

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    model, prompt, identity = tiny
    _, shards = shared
    client = KVCacheClient(shards, identity)
    task = ray.remote(num_cpus=0, max_retries=0)(replica_task).remote(shards, identity, prompt, 40)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # wait until A has persisted a few generated tokens
        try:
            if len(client.get_session("killed").token_ids) >= len(prompt) + 4:
                break
        except SessionNotFound:
            pass
        time.sleep(0.05)
    ray.cancel(task, force=True)  # kills A's worker process mid-generation
    with pytest.raises((ray.exceptions.TaskCancelledError, ray.exceptions.WorkerCrashedError)):
        ray.get(task)
    persisted = client.get_session("killed").token_ids[len(prompt):]
    assert 4 <= len(persisted) < 40
    reference = generate(model, prompt, len(persisted) + 8)
    assert persisted == reference[: len(persisted)]
    capacity = len(prompt) + len(persisted) + 10
    resumed, _ = run_replica_b(client, model, 8, capacity=capacity, session_id="killed")
    assert resumed == reference[len(persisted):]
