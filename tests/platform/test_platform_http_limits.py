"""ConnectionGuard's caps and limits, driven through ASGI in process (the live raw-socket suite is
tests/reliability/test_reliability_hostile_clients.py)."""

import asyncio

import httpx

from msaserve.platform.config import HttpConfig
from msaserve.platform.http_limits import ConnectionGuard, HttpLimits, proxy_middlewares


def limits(**overrides) -> HttpLimits:
    return HttpLimits.from_config(HttpConfig(**overrides), in_proxy=False)


async def blocking_app(scope, receive, send) -> None:
    """Reads the body, then holds the response until released."""
    while (await receive()).get("more_body"):
        pass
    await scope["app_release"].wait()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def run_concurrent(
    guard_limits: HttpLimits, clients: list[str], forwarded_for: list[str] | None = None
) -> list[int]:
    async def go() -> list[int]:
        release = asyncio.Event()

        async def app(scope, receive, send):
            scope["app_release"] = release
            await blocking_app(scope, receive, send)

        guard = ConnectionGuard(app, guard_limits)

        async def one(client: str, forwarded: str | None) -> int:
            transport = httpx.ASGITransport(app=guard, client=(client, 1234))
            headers = {"X-Forwarded-For": forwarded} if forwarded else {}
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                return (await http.post("/x", content=b"{}", headers=headers)).status_code

        hops = forwarded_for or [None] * len(clients)
        tasks = [asyncio.create_task(one(c, f)) for c, f in zip(clients, hops, strict=True)]
        await asyncio.sleep(0.2)
        release.set()
        return list(await asyncio.gather(*tasks))

    return asyncio.run(go())


def test_requests_per_client_are_capped() -> None:
    statuses = run_concurrent(limits(max_requests_per_client=2), ["10.0.0.1"] * 4 + ["10.0.0.2"])
    assert sorted(statuses[:4]) == [200, 200, 429, 429] and statuses[4] == 200


def test_requests_in_all_are_capped() -> None:
    statuses = run_concurrent(limits(max_requests=3), [f"10.0.0.{i}" for i in range(5)])
    assert sorted(statuses) == [200, 200, 200, 503, 503]


def test_a_stalled_body_gets_408() -> None:
    async def go() -> httpx.Response:
        async def stalled_body():
            yield b'{"a": '
            await asyncio.sleep(5)
            yield b"1}"

        async def app(scope, receive, send):
            scope["app_release"] = asyncio.Event()
            scope["app_release"].set()
            await blocking_app(scope, receive, send)

        guard = ConnectionGuard(app, limits(body_read_timeout_s=0.3))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://t") as http:
            return await http.post("/x", content=stalled_body())

    response = asyncio.run(go())
    assert response.status_code == 408 and response.json()["error"]["code"] == "request_timeout"


def test_the_proxy_callback_reads_its_limits_from_the_environment(monkeypatch) -> None:
    from msaserve.platform import http_limits

    for name in (http_limits.LIMITS_ENV, http_limits.PROXY_CALLBACK_ENV):
        monkeypatch.delenv(name, raising=False)  # restored to absent after the test
    http_limits.apply_proxy_limits(HttpConfig(header_timeout_s=7.0, max_requests_per_client=5))
    (middleware,) = proxy_middlewares()
    assert middleware.cls is ConnectionGuard
    assert middleware.kwargs["limits"].header_timeout_s == 7.0
    assert middleware.kwargs["limits"].max_requests_per_client == 5


def test_clients_cannot_override_serves_timeout_or_disconnect_handling() -> None:
    seen: list = []

    async def app(scope, receive, send):
        seen.extend(scope["headers"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def go() -> None:
        guard = ConnectionGuard(app, limits())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://t") as http:
            headers = {"x-request-timeout-seconds": "0", "x-request-disconnect-disabled": "?1", "x-keep": "1"}
            await http.get("/x", headers=headers)

    asyncio.run(go())
    names = {name for name, _ in seen}
    assert b"x-keep" in names
    assert not names & {b"x-request-timeout-seconds", b"x-request-disconnect-disabled"}


def test_x_forwarded_for_from_an_untrusted_peer_does_not_split_the_per_client_cap() -> None:
    """A client that writes a new X-Forwarded-For on each request is still one client (before the
    fix, uvicorn's default trust of 127.0.0.1 in the proxy made each request a new client)."""
    statuses = run_concurrent(
        limits(max_requests_per_client=2), ["127.0.0.1"] * 4, [f"203.0.113.{i}" for i in range(4)]
    )
    assert sorted(statuses) == [200, 200, 429, 429]


def test_x_forwarded_for_from_a_trusted_proxy_names_the_client() -> None:
    statuses = run_concurrent(
        limits(max_requests_per_client=2, trusted_proxies=["10.1.0.0/16"]),
        ["10.1.2.3"] * 4 + ["10.1.2.4"],
        ["198.51.100.7"] * 3 + ["198.51.100.8, 10.1.9.9", "198.51.100.8"],
    )
    # 198.51.100.7 has 2 + a 429; .8 came through two trusted proxies and another trusted peer: 2 OK
    assert sorted(statuses[:3]) == [200, 200, 429] and statuses[3:] == [200, 200]


def test_trusted_proxies_must_be_addresses_or_networks() -> None:
    import pytest

    from msaserve.platform.config import ConfigError, ServeConfig

    with pytest.raises(ConfigError, match=r"http.trusted_proxies.*'ingress'.*CIDR"):
        ServeConfig.from_dict({"http": {"trusted_proxies": ["10.0.0.0/8", "ingress"]}})


def test_the_proxy_trusts_x_forwarded_for_only_from_configured_proxies(monkeypatch) -> None:
    """uvicorn (Serve's proxy server) rewrites the client from X-Forwarded-For for the peers in
    FORWARDED_ALLOW_IPS, 127.0.0.1 unless set: the proxy callback sets it to http.trusted_proxies."""
    import uvicorn

    from msaserve.platform import http_limits

    for name in (http_limits.LIMITS_ENV, "FORWARDED_ALLOW_IPS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(http_limits.LIMITS_ENV, "{}")
    proxy_middlewares()
    seen: list = []

    async def app(scope, receive, send):
        seen.append(scope["client"][0])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def go() -> None:
        config = uvicorn.Config(app, lifespan="off")
        config.load()
        transport = httpx.ASGITransport(app=config.loaded_app, client=("127.0.0.1", 5))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            await http.get("/", headers={"X-Forwarded-For": "203.0.113.9"})

    asyncio.run(go())
    assert seen == ["127.0.0.1"]
    monkeypatch.setenv(http_limits.LIMITS_ENV, '{"trusted_proxies": ["127.0.0.1"]}')
    proxy_middlewares()
    asyncio.run(go())
    assert seen[-1] == "203.0.113.9"
