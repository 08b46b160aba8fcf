"""Sessions that move between replicas through the KV cache service (live: local Ray, two `tiny`
model replicas, kvcache enabled). Every turn's tokens are checked exactly against a local engine
that never moved, read back from the session's record in the service (the tiny model's byte
tokenizer cannot round-trip its random tokens through text)."""

import time

import httpx
import pytest
import ray
import torch

from msaserve.engine.kv.pages import identity_for
from msaserve.engine.llm_engine import LLMEngine, load_engine_model
from msaserve.engine.memory import cache_dtypes
from msaserve.engine.types import GenerateRequest, SamplingParams
from msaserve.kvcache.client import KVCacheClient
from msaserve.kvcache.config import ServiceConfig
from msaserve.platform.app import APP_NAME
from msaserve.platform.model_deployment import engine_config_from
from msaserve.platform.tenants import make_tenant

SERVE_CONFIG = {
    "model": {"spec": "tiny"},
    "engine": {"max_num_seqs": 4, "max_waiting": 16, "max_model_len": 1024},
    "deployments": {"model": {"num_replicas": 2}},
    "kvcache": {"enabled": True, "memory_bytes": 64 << 20},
    "router": {"stats_period_s": 0.5},
    "auth": {"api_keys": ["owner-key", "other-key"]},
}
MAX_TOKENS, SESSION = 4, "conversation-1"
AUTH, OTHER = {"Authorization": "Bearer owner-key"}, {"Authorization": "Bearer other-key"}
SCOPED = make_tenant("owner-key").scope(SESSION)  # how the gateway stores it: under the key's tenant


@pytest.fixture(scope="module")
def reference(live_app):
    """The replicas' model, run locally without moving: the three turns' token ids."""
    engine_config = engine_config_from(live_app.config)
    model, tokenizer = load_engine_model(engine_config)
    engine = LLMEngine(engine_config, model, tokenizer)
    kv_dtype, index_dtype = cache_dtypes(engine_config)
    identity = identity_for(model.config, live_app.config.model.resolved_name(), kv_dtype, index_dtype)
    service = KVCacheClient.connect(ServiceConfig.from_settings(live_app.config.kvcache), identity)
    prompts, histories, history = [], [], []
    for turn in range(3):
        # The gateway takes only ids its tokenizer knows (the byte tokenizer's 259) while the
        # random model emits any of 512: pick each turn's new text so that its reply stays in range.
        for attempt in range(500):
            extra = torch.randint(3, 259, (100 if turn == 0 else 20,),
                                  generator=torch.Generator().manual_seed(1000 * turn + attempt)).tolist()
            prompt = history + extra
            greedy = SamplingParams(MAX_TOKENS, temperature=0.0)
            engine.add_request(GenerateRequest(f"ref-{turn}-{attempt}", prompt, greedy))
            out: list[int] = []
            while engine.has_unfinished():
                for output in engine.step():
                    out.extend(output.token_ids)
            if all(t < tokenizer.vocab_size for t in out):
                break
        prompts.append(prompt)
        history = prompt + out
        histories.append(history)
    return prompts, histories, service


def complete(live_app, prompt: list[int]) -> httpx.Response:
    body = {"model": live_app.config.model.resolved_name(), "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0.0}
    return httpx.post(live_app.base_url + "/v1/completions", json=body,
                      headers={"X-Session-Id": SESSION, **AUTH}, timeout=60)


def home_of(live_app) -> dict:
    response = httpx.get(f"{live_app.base_url}/v1/sessions/{SESSION}", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_moved_and_failed_over_sessions_continue_with_identical_tokens(live_app, reference):
    prompts, expected, service = reference

    assert complete(live_app, prompts[0]).status_code == 200
    first = home_of(live_app)["replica_id"]
    assert service.get_session(SCOPED).token_ids == expected[0]  # persisted at the end of the turn

    unknown = httpx.post(f"{live_app.base_url}/v1/sessions/nobody/move", headers=AUTH, timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "session_not_found"
    bogus = httpx.post(f"{live_app.base_url}/v1/sessions/{SESSION}/move", json={"target_replica": "x"},
                       headers=AUTH)
    assert bogus.status_code == 400 and first in bogus.json()["error"]["message"]  # names the allowed
    for body, param in [({"to": "x"}, "to"), ({"target_replica": first}, "target_replica"), ([1], "body")]:
        refused = httpx.post(f"{live_app.base_url}/v1/sessions/{SESSION}/move", json=body, headers=AUTH)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    # Another API key can neither move it nor see it (issue 26: sessions belong to their key).
    for method in ("POST", "GET", "DELETE"):
        path = f"/v1/sessions/{SESSION}" + ("/move" if method == "POST" else "")
        stolen = httpx.request(method, live_app.base_url + path, headers=OTHER, timeout=30)
        assert stolen.status_code == 404, (method, stolen.text)
    assert home_of(live_app)["replica_id"] == first
    moved = httpx.post(f"{live_app.base_url}/v1/sessions/{SESSION}/move", headers=AUTH, timeout=30)
    assert moved.status_code == 200, moved.text
    assert moved.json()["from_replica"] == first and moved.json()["to_replica"] != first
    assert moved.json()["pages_released"] > 0

    turn2 = complete(live_app, prompts[1])
    assert turn2.status_code == 200, turn2.text
    second = home_of(live_app)
    assert second["replica_id"] == moved.json()["to_replica"]
    assert second["num_cached_tokens"] >= 100  # adopted from the service, not prefilled
    assert service.get_session(SCOPED).token_ids == expected[1]

    # The new home dies: the next turn resumes on the other replica from the service.
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#Model#{second['replica_id']}", namespace="serve"),
             no_restart=True)
    deadline = time.monotonic() + 30
    while (response := complete(live_app, prompts[2])).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.5)  # the router learns of the death from the failed call or the controller
    assert response.status_code == 200, response.text
    assert service.get_session(SCOPED).token_ids == expected[2]
    assert home_of(live_app)["replica_id"] != second["replica_id"]

    # Adoptions are measured: index-load latency reaches the replicas' metrics export.
    deadline = time.monotonic() + 20
    while "ray_msaserve_index_load_latency_seconds_count" not in httpx.get(live_app.metrics_url).text:
        assert time.monotonic() < deadline, "no index-load latency exported"
        time.sleep(0.5)

    # DELETE forgets the session everywhere: the replica's table and the service's record.
    deleted = httpx.delete(f"{live_app.base_url}/v1/sessions/{SESSION}", headers=AUTH, timeout=30)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True, deleted.text
    assert SCOPED not in service.list_sessions()
    again = httpx.delete(f"{live_app.base_url}/v1/sessions/{SESSION}", headers=AUTH, timeout=30)
    assert again.status_code == 404
