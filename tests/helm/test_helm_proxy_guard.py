"""Serve's HTTP proxy on every Ray pod gets the slowloris guard `msaserve serve` installs locally
(msaserve/platform/http_limits.py): the callback Serve calls, the `http` limits it reads, and the
trusted X-Forwarded-For peers. Each pod is read as the proxy would: its env, fed to the callback."""

import os
from typing import Any

import pytest
from starlette.middleware import Middleware

from msaserve.platform import http_limits
from msaserve.platform.config import HttpConfig

PROFILES = ["default", "gpu", "all-features", "m3", "minimal"]


def _containers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """'head' and each worker group → its Ray container."""
    [service] = [d for d in docs if d["kind"] == "RayService"]
    cluster = service["spec"]["rayClusterConfig"]
    groups = {"head": cluster["headGroupSpec"], **{g["groupName"]: g for g in cluster["workerGroupSpecs"]}}
    return {name: g["template"]["spec"]["containers"][0] for name, g in groups.items()}


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def _proxy_guard(env: dict[str, str], monkeypatch) -> tuple[Middleware, str]:
    """What Serve's proxy on a pod with this env installs: (the middleware, uvicorn's trusted peers)."""
    module, _, function = env[http_limits.PROXY_CALLBACK_ENV].partition(":")
    assert module == "msaserve.platform.http_limits"
    monkeypatch.setenv(http_limits.LIMITS_ENV, env[http_limits.LIMITS_ENV])
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", env["FORWARDED_ALLOW_IPS"])
    (middleware,) = getattr(http_limits, function)()
    return middleware, os.environ["FORWARDED_ALLOW_IPS"]


@pytest.mark.parametrize("profile", PROFILES)
def test_every_ray_pod_installs_the_proxy_guard_with_serve_config_defaults(
    rendered, profile: str, monkeypatch
) -> None:
    defaults = http_limits.HttpLimits.from_config(HttpConfig(), in_proxy=True)
    containers = _containers(rendered[profile])
    assert "head" in containers and len(containers) >= 2
    for name, container in containers.items():
        middleware, trusted = _proxy_guard(_env(container), monkeypatch)
        assert middleware.cls is http_limits.ConnectionGuard, name
        limits = middleware.kwargs["limits"]
        assert limits.header_timeout_s == defaults.header_timeout_s == 10.0, name
        assert limits.body_read_timeout_s == defaults.body_read_timeout_s, name
        assert limits.max_requests_per_client == defaults.max_requests_per_client, name
        assert trusted == "", name  # uvicorn's default would trust 127.0.0.1


def test_the_proxy_guard_follows_serve_http(render, monkeypatch) -> None:
    http = {"header_timeout_s": 4.5, "body_read_timeout_s": 12.0, "max_requests_per_client": 9,
            "trusted_proxies": ["10.0.0.0/8", "fd00::/8"]}  # fmt: skip
    docs = render({"serve": {"http": http}})
    for name, container in _containers(docs).items():
        middleware, trusted = _proxy_guard(_env(container), monkeypatch)
        limits = middleware.kwargs["limits"]
        assert (limits.header_timeout_s, limits.body_read_timeout_s) == (4.5, 12.0), name
        assert limits.max_requests_per_client == 9, name
        assert limits.trusted_proxies == ("10.0.0.0/8", "fd00::/8"), name
        assert trusted == "10.0.0.0/8,fd00::/8", name
        assert _env(container)["FORWARDED_ALLOW_IPS"] == trusted, name
