"""Faults: a KV cache shard is killed under the live platform (local Ray Serve, 2 `tiny` model
replicas, a 2-shard KV cache service with a write-through disk tier), and the engine's queues are
flooded past `engine.max_waiting`.

Shard kill: six sessions run a turn; the next turn of all six is in flight when shard 0 dies
(`ray.kill`, no_restart=False: Ray restarts it over the same disk path). Every session is then
moved to the other replica, so its third turn must come from the service (the restarted shard
reads its pages from the disk tier) or be recomputed. What the client must see: only 200s (or
the documented retryable 503/429, which the client retries); every turn's tokens exactly those
of a fault-free run (checked on the session's record in the service, which also proves the
restarted shard persists again). What the metrics must count: one 200 per request the client saw
succeed and no 5xx, disk-tier hits on the restarted shard, one index load per adoption, no
corrupt page.

Overload: more concurrent requests than the replicas' running + waiting slots: the excess gets
429 queue_full with Retry-After (counted as such in the metrics), the queues never hold more than
max_waiting, and they drain completely afterwards."""

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
import ray
from local_serve_app import LiveApp, start_live_app
from reliability_metrics import metric, requests_counted, samples, scrape, wait_for_metric
from reliability_sessions import make_scripts, record_reader, reference_engine

from msaserve.kvcache.config import ServiceConfig
from msaserve.kvcache.keys import shard_of_session
from msaserve.platform.config import ServeConfig

pytestmark = pytest.mark.slow

MAX_WAITING, MAX_NUM_SEQS = 4, 3
SERVE_CONFIG = {
    "model": {"spec": "tiny"},
    "engine": {"max_num_seqs": MAX_NUM_SEQS, "max_waiting": MAX_WAITING, "max_model_len": 1024},
    "router": {"stats_period_s": 0.5},
    "deployments": {"model": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}}},
}  # fmt: skip
NUM_SESSIONS, NUM_TURNS = 6, 3


@pytest.fixture(scope="module")
def app(tmp_path_factory) -> Iterator[LiveApp]:
    disk = tmp_path_factory.mktemp("kvcache")
    kvcache = {"enabled": True, "num_shards": 2, "memory_bytes": 32 << 20, "disk_path": str(disk),
               "disk_bytes": 256 << 20}  # fmt: skip
    with start_live_app({**SERVE_CONFIG, "kvcache": kvcache}) as running:
        yield running


async def turn(
    http: httpx.AsyncClient, app: LiveApp, sid: str, prompt: list[int], n: int, counts: dict[int, int]
) -> httpx.Response:
    """One turn; a retryable answer (429, or 503 with Retry-After) is sent again, 10 times at most.
    counts: every answer's status, retried ones included."""
    body = {"model": app.config.model.resolved_name(), "prompt": prompt, "max_tokens": n,
            "temperature": 0.0, "ignore_eos": True}  # fmt: skip
    for _ in range(10):
        response = await http.post(app.base_url + "/v1/completions", json=body, headers={"X-Session-Id": sid})
        counts[response.status_code] = counts.get(response.status_code, 0) + 1
        if response.status_code not in (429, 503) or "retry-after" not in response.headers:
            return response
        await asyncio.sleep(float(response.headers["retry-after"]))
    return response


def session_ids() -> list[str]:
    """Three sessions on each of the two shards."""
    ids = {0: [], 1: []}
    for i in range(100):
        sid = f"shard-kill-{i}"
        if len(ids[shard_of_session(sid, 2)]) < NUM_SESSIONS // 2:
            ids[shard_of_session(sid, 2)].append(sid)
    return ids[0] + ids[1]


def server_errors(text: str) -> float:
    """5xx answers the gateway counted, every route."""
    return sum(s.value for s in samples(text, "ray_msaserve_requests_total") if s.labels["status"][0] == "5")


def shard_actor(app: LiveApp, shard: int):
    config = ServiceConfig.from_settings(app.config.kvcache)
    return ray.get_actor(config.actor_name(shard), namespace=config.namespace)


async def run_sessions(app: LiveApp, scripts, sids: list[str], counts: dict[int, int]) -> None:
    async with httpx.AsyncClient(timeout=60) as http:

        async def all_turns(k: int) -> list[httpx.Response]:
            calls = [turn(http, app, sid, s.prompts[k], len(s.replies[k]), counts)
                     for sid, s in zip(sids, scripts, strict=True)]  # fmt: skip
            return await asyncio.gather(*calls)

        for k in range(NUM_TURNS):
            if k == 1:  # shard 0 dies while the second turn of every session is in flight
                pending = asyncio.ensure_future(all_turns(k))
                await asyncio.sleep(0.05)
                ray.kill(shard_actor(app, 0), no_restart=False)
                responses = await pending
                await asyncio.to_thread(wait_until_answering, app, 0)
                for sid in sids:  # to the other replica: the next turn comes from the service
                    moved = await http.post(f"{app.base_url}/v1/sessions/{sid}/move")
                    assert moved.status_code == 200, moved.text
            else:
                responses = await all_turns(k)
            for r in responses:
                assert r.status_code == 200, r.text  # nothing but retried-away retryable answers


def test_a_killed_kvcache_shard_loses_no_session_and_serves_nothing_corrupted(app: LiveApp) -> None:
    engine, tokenizer = reference_engine(ServeConfig.from_dict(SERVE_CONFIG))
    scripts = make_scripts(engine, tokenizer, NUM_SESSIONS, NUM_TURNS, seed=7)
    sids = session_ids()
    before = scrape(app.metrics_url)
    counts: dict[int, int] = {}
    asyncio.run(run_sessions(app, scripts, sids, counts))

    read = record_reader(app.config, engine)
    for sid, script in zip(sids, scripts, strict=True):  # exact tokens, persisted again after the kill
        assert read(sid) == script.prompts[-1] + script.replies[-1], sid

    text = wait_for_metric(app.metrics_url, lambda t: requests_counted(before, t, "200") >= counts[200])
    assert requests_counted(before, text, "200") == counts[200]
    assert set(counts) <= {200, 429, 503}, counts
    assert server_errors(text) - server_errors(before) == counts.get(503, 0)  # only what the client saw
    disk_hits = {"name": "ray_msaserve_kvcache_hits_total", "shard": "0", "tier": "disk"}
    text = wait_for_metric(app.metrics_url, lambda t: metric(t, **disk_hits) > 0)
    assert metric(text, **disk_hits) > 0  # the restarted shard served pages from its disk tier
    assert metric(text, "ray_msaserve_kvcache_corruptions_total") == 0
    adoptions = metric(text, "ray_msaserve_index_load_latency_seconds_count")
    adoptions -= metric(before, "ray_msaserve_index_load_latency_seconds_count")
    hits = metric(text, **disk_hits)
    print(f"shard kill: answers {counts}, disk-tier hits on shard 0 {hits:.0f}, adoptions {adoptions:.0f}")
    assert adoptions >= 1, "no session was adopted from the service after the moves"


FLOOD = 40
"""Concurrent requests, against 2 × (MAX_NUM_SEQS running + MAX_WAITING waiting) = 14 slots."""


async def flood(app: LiveApp, seen_waiting: list[int]) -> list[httpx.Response]:
    body = {"model": app.config.model.resolved_name(), "prompt": list(range(3, 200)), "max_tokens": 96,
            "temperature": 0.0, "ignore_eos": True}  # fmt: skip
    done = asyncio.Event()

    async def watch() -> None:  # the queue of whichever replica answers, while the flood runs
        while not done.is_set():
            stats = await asyncio.to_thread(app.engine_stats)
            seen_waiting.append(stats.num_waiting)
            await asyncio.sleep(0.02)

    watcher = asyncio.ensure_future(watch())
    async with httpx.AsyncClient(timeout=60) as http:
        responses = await asyncio.gather(
            *(http.post(app.base_url + "/v1/completions", json=body) for _ in range(FLOOD))
        )
    done.set()
    await watcher
    return list(responses)


def test_a_flood_past_the_queues_gets_429s_and_the_queues_stay_bounded(app: LiveApp) -> None:
    before = scrape(app.metrics_url)
    seen_waiting: list[int] = []
    responses = asyncio.run(flood(app, seen_waiting))
    statuses = sorted(r.status_code for r in responses)
    refused = [r for r in responses if r.status_code == 429]
    assert set(statuses) <= {200, 429}, [r.text for r in responses if r.status_code not in (200, 429)]
    assert 0 < len(refused) < FLOOD, statuses  # (how many depends on how fast the first ones finish)
    for r in refused:
        assert r.json()["error"]["code"] == "queue_full" and float(r.headers["retry-after"]) > 0, r.text
    assert seen_waiting and max(seen_waiting) <= MAX_WAITING, seen_waiting
    print(f"flood: {FLOOD - len(refused)} × 200, {len(refused)} × 429; most waiting seen {max(seen_waiting)}")

    text = wait_for_metric(app.metrics_url, lambda t: requests_counted(before, t, "429") >= len(refused))
    assert requests_counted(before, text, "429") == len(refused)

    deadline = time.monotonic() + 20  # the queues drain: nothing of the flood stays buffered
    while any(s.num_running or s.num_waiting for s in [app.engine_stats() for _ in range(4)]):
        assert time.monotonic() < deadline, "the queues did not drain in 20 s"
        time.sleep(0.2)


def wait_until_answering(app: LiveApp, shard_id: int, timeout_s: float = 60.0) -> None:
    """Ping the killed shard until its restarted actor answers. A ping that reaches the actor while
    Ray restarts it fails with ActorUnavailableError ("may or may not have been executed"): retry."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(shard_actor(app, shard_id).ping.remote(), timeout=max(1.0, deadline - time.monotonic()))
            return
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
