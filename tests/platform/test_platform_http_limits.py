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


def run_concurrent(guard_limits: HttpLimits, clients: list[str]) -> list[int]:
    async def go() -> list[int]:
        release = asyncio.Event()

        async def app(scope, receive, send):
            scope["app_release"] = release
            await blocking_app(scope, receive, send)

        guard = ConnectionGuard(app, guard_limits)

        async def one(client: str) -> int:
            transport = httpx.ASGITransport(app=guard, client=(client, 1234))
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                return (await http.post("/x", content=b"{}")).status_code

        tasks = [asyncio.create_task(one(c)) for c in clients]
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
