"""Issue 26, items 4 and 5 on a real local Ray Serve app (one `tiny` model replica):

- every port the local Ray and Serve open listens on loopback (they listened on 0.0.0.0 / `::` /
  the machine's IP: gRPC of the GCS, raylet and each worker, the dashboard agent, the metrics port);
- `/metrics` (Prometheus text) is on the API port, behind the API key;
- `/health` is liveness and stays 200 while the only model replica is dead, and `/ready` (a replica
  answered a 1-token probe within http.ready_probe_timeout_s) is 503 then, and 200 again once
  Serve has replaced the replica. Every wait is bounded."""

import ipaddress
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest
import ray
from local_serve_app import LiveApp, start_live_app
from reliability_metrics import metric

from msaserve.platform.app import APP_NAME

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

KEY = "ready-key"
PROBE_TIMEOUT_S = 3.0
SERVE_CONFIG = {
    "model": {"spec": "tiny"},
    "engine": {"max_num_seqs": 4, "max_waiting": 16, "max_model_len": 512},
    "auth": {"api_keys": [KEY]},
    "http": {"ready_probe_timeout_s": PROBE_TIMEOUT_S, "ready_cache_s": 0.0},
}
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def app() -> Iterator[LiveApp]:
    with start_live_app(SERVE_CONFIG, num_cpus=2) as running:
        yield running


def listening_sockets_of_this_ray() -> list[tuple[str, int, str]]:
    """(address, port, process) of every listening TCP socket of this process and its descendants
    (the GCS, raylet, dashboard agent, every Ray worker: ray.init starts them as children)."""
    me = psutil.Process()
    tree = {p.pid: p for p in [me, *me.children(recursive=True)]}
    out = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in tree:
            name = " ".join(tree[conn.pid].cmdline()[:1])[-60:]
            out.append((conn.laddr.ip, conn.laddr.port, name))
    return out


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def test_every_ray_and_serve_port_listens_on_loopback(app: LiveApp) -> None:
    sockets = listening_sockets_of_this_ray()
    assert len(sockets) >= 8, sockets  # the GCS, raylet, agents, controller, proxy, replicas, ...
    exposed = [s for s in sockets if not is_loopback(s[0])]
    assert not exposed, f"listening beyond loopback: {exposed}"
    assert all(n["NodeManagerAddress"] == "127.0.0.1" for n in ray.nodes())


def test_metrics_on_the_api_port_behind_the_key(app: LiveApp) -> None:
    assert httpx.get(app.base_url + "/metrics", timeout=30).status_code == 401
    body = {"model": "msaserve/tiny", "prompt": "hi", "max_tokens": 2}
    answer = httpx.post(app.base_url + "/v1/completions", json=body, headers=AUTH, timeout=60)
    assert answer.status_code == 200, answer.text
    deadline = time.monotonic() + 30
    while True:  # Ray exports a replica's metrics about once a second
        response = httpx.get(app.base_url + "/metrics", headers=AUTH, timeout=30)
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
        count = metric(response.text, "ray_msaserve_requests_total", route="/v1/completions", status="200")
        if count >= 1 or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert count >= 1, response.text[:2000]


def only_model_replica():
    prefix = f"SERVE_REPLICA::{APP_NAME}#Model#"
    actors = ray.util.list_named_actors(all_namespaces=True)
    names = [a["name"] for a in actors if a["name"].startswith(prefix)]
    assert len(names) == 1, names
    return ray.get_actor(names[0], namespace="serve")


def test_ready_follows_the_model_replica_and_health_is_liveness(app: LiveApp) -> None:
    ready = httpx.get(app.base_url + "/ready", timeout=30)
    assert ready.status_code == 200 and ready.json()["status"] == "ready", ready.text
    ray.kill(only_model_replica(), no_restart=True)
    killed_at = time.monotonic()
    seen_503, statuses = None, []
    while time.monotonic() - killed_at < 60:
        response = httpx.get(app.base_url + "/ready", timeout=PROBE_TIMEOUT_S + 30)
        statuses.append(response.status_code)
        assert httpx.get(app.base_url + "/health", timeout=10).status_code == 200  # the gateway lives
        if response.status_code == 503:
            seen_503 = response
            break
        time.sleep(0.2)
    assert seen_503 is not None, f"/ready never 503 after the only model replica died: {statuses}"
    error = seen_503.json()["error"]
    assert error["type"] == "service_unavailable" and int(seen_503.headers["retry-after"]) >= 1, error
    deadline = time.monotonic() + 180  # Serve starts a replacement; its engine loads
    while httpx.get(app.base_url + "/ready", timeout=PROBE_TIMEOUT_S + 30).status_code != 200:
        assert time.monotonic() < deadline, "/ready did not recover after the replica was replaced"
        time.sleep(1.0)
