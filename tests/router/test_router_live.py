"""The KV-aware router live: a local Ray Serve app (platform `build_app`) with 3 CPU replicas of the
`tiny` preset, driven over HTTP. Where a request ran is read back through GET /v1/sessions/{id}
(the replica's own session table, reached through the router's session affinity) and through
`usage.prompt_tokens_details.cached_tokens` (the engine's prefix-cache hits)."""

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray
from local_serve_app import start_live_app

from msaserve.platform.app import APP_NAME

pytestmark = pytest.mark.slow

KEY = "router-key"
PAGE = 16  # the tiny preset's page size
SERVE_CONFIG = {
    "model": {"spec": "tiny"},
    "engine": {"max_num_seqs": 8, "max_waiting": 64, "max_model_len": 2048},
    "router": {"policy": "kv_aware", "stats_period_s": 0.25},
    "auth": {"api_keys": [KEY]},
    "deployments": {"model": {"num_replicas": 3, "max_ongoing_requests": 4,
                              "ray_actor_options": {"num_cpus": 0.5}}},
}


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with start_live_app(SERVE_CONFIG, timeout_s=180) as app:
        _wait_all_replicas_ready(app.base_url)
        yield app.base_url


def _wait_all_replicas_ready(url: str) -> None:
    """/health is 200 once one engine is up; warm-up requests until every replica answers."""
    deadline = time.monotonic() + 180
    seen: set[str] = set()
    i, last = 0, None
    while len(seen) < 3:
        assert time.monotonic() < deadline, f"only replicas {seen} served in 180 s; last: {last}"
        session = f"warmup-{i}"
        i += 1
        response = complete(url, tokens(20, seed=i), session, check=False)
        if response.status_code == 200:
            seen.add(session_replica(url, session))
        else:
            last = f"{response.status_code} {response.text[:300]}"
            time.sleep(0.5)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]  # the tiny tokenizer has 259 ids


def complete(url: str, prompt: list[int], session: str | None, max_tokens: int = 4,
             check: bool = True) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}"}
    if session:
        headers["x-session-id"] = session
    body = {"model": "msaserve/tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)
    if check:
        assert response.status_code == 200, response.text
    return response


def cached(response: httpx.Response) -> int:
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def session_replica(url: str, session: str) -> str:
    response = httpx.get(f"{url}/v1/sessions/{session}", headers={"Authorization": f"Bearer {KEY}"},
                         timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["replica_id"]


def test_conversation_turns_stay_on_one_replica(base_url):
    for conv in range(4):
        session, prompt = f"conv-{conv}", tokens(100, seed=100 + conv)
        for turn in range(3):
            response = complete(base_url, prompt, session)
            if turn:  # the earlier turns' full pages came from this replica's prefix cache
                assert cached(response) >= (len(prompt) - 20) // PAGE * PAGE - PAGE, (conv, turn)
            prompt = prompt + tokens(20, seed=1000 * conv + turn)
        info = httpx.get(f"{base_url}/v1/sessions/{session}", headers={"Authorization": f"Bearer {KEY}"},
                         timeout=30).json()
        assert info["num_turns"] == 3, info  # every turn was recorded by the same replica


def test_new_conversation_sharing_a_long_prefix_lands_where_it_is_cached(base_url):
    prefix = tokens(40 * PAGE, seed=7)  # a long shared system prompt
    complete(base_url, prefix + tokens(10, seed=8), "prefix-owner")
    holder = session_replica(base_url, "prefix-owner")
    time.sleep(1.0)  # let the holder's KV events reach the router
    for i in range(3):
        response = complete(base_url, prefix + tokens(10, seed=20 + i), f"prefix-new-{i}")
        assert session_replica(base_url, f"prefix-new-{i}") == holder
        assert cached(response) >= len(prefix) - PAGE


def test_a_saturated_replica_spills_to_the_others(base_url):
    prefix = tokens(40 * PAGE, seed=77)
    complete(base_url, [*prefix, 5], "spill-owner")
    holder = session_replica(base_url, "spill-owner")
    time.sleep(1.0)
    sessions = [f"spill-{i}" for i in range(12)]
    with ThreadPoolExecutor(len(sessions)) as pool:
        responses = list(pool.map(
            lambda s: complete(base_url, prefix + tokens(8, seed=hash(s) % 1000), s, max_tokens=48),
            sessions))
    assert all(r.status_code == 200 for r in responses)
    placed = [session_replica(base_url, s) for s in sessions]
    assert holder in placed  # the prefix still attracts requests...
    assert len(set(placed)) >= 2  # ...but not beyond what the holder can take at once


def test_a_killed_replicas_traffic_goes_elsewhere_without_errors(base_url):
    complete(base_url, tokens(50, seed=300), "doomed")
    victim = session_replica(base_url, "doomed")
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#Model#{victim}", namespace="serve"), no_restart=True)
    responses = [complete(base_url, tokens(30, seed=400 + i), f"after-kill-{i}", check=False)
                 for i in range(6)]
    responses.append(complete(base_url, [*tokens(50, seed=300), 7, 8, 9], "doomed", check=False))
    assert [r.status_code for r in responses] == [200] * len(responses), [r.text for r in responses]
    for session in [f"after-kill-{i}" for i in range(6)] + ["doomed"]:
        assert session_replica(base_url, session) != victim
