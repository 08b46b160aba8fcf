"""The gateway's FastAPI app in this process, in front of a real `ModelDeployment` (real engine, tiny
model, CPU), without Ray: the fast way to drive every route (unit tests, the in-process fuzz).

Only the transport is replaced: `LocalHandle` calls the deployment object's methods directly where
Ray Serve would send them to a replica (`handle.method.remote(...)`, `options(stream=True)` for an
async-generator method, `.cancel()` on a stream). Routing options (`session_id`) have no meaning
with one replica and are accepted and dropped.
"""

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import httpx

from msaserve.platform.config import ServeConfig
from msaserve.platform.gateway import GatewayContext, create_api
from msaserve.platform.metrics import PlatformMetrics
from msaserve.platform.model_deployment import ModelDeployment
from msaserve.platform.preprocess_deployment import PreprocessDeployment


class _Stream:
    """What `handle.options(stream=True).method.remote()` returns: async iteration and cancel()."""

    def __init__(self, agen: AsyncIterator[Any]) -> None:
        self._agen = agen
        self._task: asyncio.Task | None = None

    def __aiter__(self) -> "_Stream":
        return self

    async def __anext__(self) -> Any:
        return await self._agen.__anext__()

    def cancel(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._agen.aclose())


class _Method:
    def __init__(self, target: Any, name: str, stream: bool) -> None:
        self.target, self.name, self.stream = target, name, stream

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        result = getattr(self.target, self.name)(*args, **kwargs)
        return _Stream(result) if self.stream else _awaitable(result)


async def _awaitable(result: Any) -> Any:
    return await result if asyncio.iscoroutine(result) else result


class LocalHandle:
    """A DeploymentHandle's calling convention over one in-process deployment object."""

    def __init__(self, target: Any, stream: bool = False) -> None:
        self._target, self._stream = target, stream

    def options(self, *, stream: bool | None = None, **_routing: Any) -> "LocalHandle":
        return LocalHandle(self._target, self._stream if stream is None else stream)

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self._target, name, self._stream)


TINY_CONFIG: dict = {
    "model": {"spec": "tiny"},
    "engine": {"max_num_seqs": 4, "max_waiting": 8, "max_model_len": 512},
}


async def start_deployment(config: ServeConfig) -> ModelDeployment:
    deployment = ModelDeployment.__new__(ModelDeployment)
    await deployment.__init__(config.model_dump(mode="json"))
    await deployment._load_task
    assert deployment.error is None, deployment.error
    return deployment


async def stop_deployment(deployment: ModelDeployment) -> None:
    await deployment.__del__()


@asynccontextmanager
async def inprocess_client(
    data: dict | None = None, deployment: ModelDeployment | None = None, preprocess: bool = False
) -> AsyncIterator[tuple[httpx.AsyncClient, GatewayContext]]:
    """An httpx client on the gateway app for ServeConfig `data` (default: tiny). Pass a started
    `deployment` to share one engine between apps (loading it takes seconds). `preprocess`: media
    parts go to an in-process Preprocess deployment (the config's `preprocess` limits), as the Ray
    app sends them; without it the gateway has none, as for a text-only model."""
    config = ServeConfig.from_dict(data or TINY_CONFIG)
    own = deployment is None
    deployment = deployment or await start_deployment(config)
    media = None
    if preprocess:
        media = LocalHandle(PreprocessDeployment(config.preprocess.model_dump(), config.model.spec))
    ctx = GatewayContext(config, LocalHandle(deployment), media, metrics=PlatformMetrics())
    transport = httpx.ASGITransport(app=create_api(ctx), raise_app_exceptions=False)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=60) as client:
            yield client, ctx
    finally:
        if own:
            await stop_deployment(deployment)


class InProcessGateway:
    """One engine on its own event loop for a test module; `request` runs one call through a fresh
    gateway app for a ServeConfig dict (auth, limits) in front of that engine."""

    def __init__(self, data: dict | None = None, preprocess: bool = False) -> None:
        self.data = data or TINY_CONFIG
        self.preprocess = preprocess
        self.loop = asyncio.new_event_loop()
        self.deployment = self.loop.run_until_complete(start_deployment(ServeConfig.from_dict(self.data)))

    def run(self, make_coroutine: Any, data: dict | None = None) -> Any:
        """`make_coroutine(client, ctx)` on a gateway for `data` (default: the engine's config)."""

        async def go() -> Any:
            async with inprocess_client(data or self.data, self.deployment, self.preprocess) as (client, ctx):
                return await make_coroutine(client, ctx)

        return self.loop.run_until_complete(go())

    def request(self, method: str, path: str, data: dict | None = None, **kwargs: Any) -> httpx.Response:
        async def call(client: httpx.AsyncClient, _ctx: GatewayContext) -> httpx.Response:
            return await client.request(method, path, **kwargs)

        return self.run(call, data)

    def close(self) -> None:
        self.loop.run_until_complete(stop_deployment(self.deployment))
        self.loop.close()


@contextmanager
def inprocess_gateway(data: dict | None = None, preprocess: bool = False) -> Iterator[InProcessGateway]:
    gateway = InProcessGateway(data, preprocess)
    try:
        yield gateway
    finally:
        gateway.close()
