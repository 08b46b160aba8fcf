"""The Model deployment: one `AsyncEngine` per replica (CPU locally, a GPU on clusters).

The engine loads in the background after the replica starts, so the gateway can answer 503 with
Retry-After while it warms up instead of the whole application looking dead. `generate` streams the
engine's outputs to the gateway; when the gateway cancels the stream (client gone), closing the
engine's iterator aborts the request and frees its pages. `record_routing_stats` is what Ray Serve
hands the request router as this replica's load and cached page hashes.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from ray import serve

from msaserve.engine.config import EngineConfig
from msaserve.engine.types import EngineError, EngineStats, GenerateOutput, GenerateRequest, QueueFull
from msaserve.platform.config import ServeConfig
from msaserve.platform.drain_rate import DrainRate
from msaserve.platform.engine_factory import build_engine
from msaserve.platform.errors import from_engine_error
from msaserve.platform.metrics import get_metrics
from msaserve.platform.model_messages import ModelError, ModelInfo, SessionInfo
from msaserve.platform.ray_defaults import bind_replica_grpc_to_loopback
from msaserve.platform.response_store import ResponseStore, StoredResponse
from msaserve.platform.session_table import SessionTable
from msaserve.router.stats import RoutingStatsRecorder, routing_stats_payload

logger = logging.getLogger("ray.serve.msaserve.model")

ENGINE_WAIT_S = 30.0
"""How long a request that reaches a replica whose engine is still loading waits for it."""


def engine_config_from(config: ServeConfig) -> EngineConfig:
    """The engine's dataclass from the user-facing pydantic config (CONTRIBUTING.md §6)."""
    model = config.model
    dtype = model.dtype if model.dtype != "auto" else ("bfloat16" if model.device == "cuda" else "float32")
    return EngineConfig.from_settings(
        config.engine, model=model.spec, device=model.device, dtype=dtype,
        attention_backend=model.attention_backend,
    )


def _media_token_ids(model) -> tuple[int, int] | None:
    """The (image, video) placeholder ids of a model with a vision tower, else None."""
    if getattr(model, "visual", None) is None:
        return None
    return model.config.image_token_id, model.config.video_token_id


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (benchmarks construct the class directly)
        return "local"


class ModelDeployment:
    async def __init__(self, config: dict) -> None:
        logging.getLogger("ray.serve.msaserve").setLevel(logging.INFO)
        bind_replica_grpc_to_loopback()
        self.config = ServeConfig.from_dict(config)
        self.name = self.config.model.resolved_name()
        self.replica_id = _replica_id()
        self.engine = None
        self.error: str | None = None
        self.sessions = SessionTable()
        self.responses = ResponseStore()
        self.drain_rate = DrainRate()
        self.routing = RoutingStatsRecorder()
        self.routing.replica_id = self.replica_id
        self.draining = False
        """Set by `drain`: routers send this replica's sessions elsewhere (scale-down, maintenance)."""
        self.metrics = get_metrics()
        self._output_tokens = 0
        self._load_task = asyncio.create_task(self._load())
        self._tasks = [self._load_task, asyncio.create_task(self._report_loop())]

    async def _load(self) -> None:
        start = time.perf_counter()
        try:
            engine_config = engine_config_from(self.config)
            # Loading weights is blocking CPU work: keep the replica's event loop free for info().
            engine = await asyncio.to_thread(build_engine, self.config, engine_config)
            if self.config.kvcache.enabled:
                engine.use_kv_service_for_sessions()
            await engine.start()
            self.routing.page_size = engine.page_size
            self.routing.media_token_ids = _media_token_ids(engine.model)
            self.engine = engine
            logger.info("engine for %s ready in %.1fs", self.name, time.perf_counter() - start)
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
            logger.exception("engine for %s failed to load", self.name)

    async def info(self) -> ModelInfo:
        if self.engine is None:
            return ModelInfo(name=self.name, ready=False, error=self.error)
        model = self.engine.model
        has_vision = getattr(model, "visual", None) is not None
        return ModelInfo(
            name=self.name,
            ready=True,
            max_model_len=self.engine.max_model_len,
            page_size=self.engine.page_size,
            tokenizer=self.engine.tokenizer,
            image_token_id=model.config.image_token_id if has_vision else None,
            video_token_id=model.config.video_token_id if has_vision else None,
        )

    async def _engine_ready(self) -> bool:
        """Wait (at most ENGINE_WAIT_S) for an engine still loading. Serve routes to a replica as
        soon as it is constructed: a replacement for a dead replica got requests while its engine
        loaded, and answered them 503 warming_up although the other replicas were serving."""
        if self.engine is None and not self._load_task.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._load_task), ENGINE_WAIT_S)
        return self.engine is not None

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput | ModelError]:
        """Stream the engine's outputs; a refusal before the first output comes as one ModelError."""
        if not await self._engine_ready():
            yield ModelError(
                503, f"model {self.name!r} is warming up; retry shortly", code="warming_up", retry_after_s=5.0
            )
            return
        self.routing.note_session(request.session_id)
        self.sessions.begin(request.session_id, self.replica_id)
        stream = self.engine.generate(request)
        last: GenerateOutput | None = None
        try:
            try:
                first = await stream.__anext__()
            except EngineError as e:
                api = from_engine_error(e)
                if isinstance(e, QueueFull):  # when the queue ahead will have drained
                    api.retry_after_s = self.drain_rate.retry_after_s(self.engine.stats().num_waiting)
                yield ModelError(api.status, api.message, api.param, api.code, api.retry_after_s)
                return
            last = first
            self._output_tokens += len(first.token_ids)
            yield first
            if not first.finished:
                async for out in stream:
                    last = out
                    self._output_tokens += len(out.token_ids)
                    yield out
        finally:
            # Normal end, client gone (Serve cancels this generator), or failure: closing the
            # engine's iterator aborts an unfinished request and frees its pages.
            await stream.aclose()
            self.sessions.end(request.session_id, last.stats if last else None)
            if last is not None:
                self.drain_rate.note_finished()

    def record_routing_stats(self) -> dict:
        if self.engine is None:
            return {}
        stats = self.engine.stats()
        events = self.engine.drain_kv_events()
        return routing_stats_payload(stats, events, self.routing, draining=self.draining,
                                     waiting_prefill_pages=stats.waiting_prefill_pages)

    async def routing_snapshot(self, target: dict) -> dict:
        """A router's resync: every page hash this replica held at its last payload, and the
        payload's seq (`target` names the replica the router meant; it checks the answer's)."""
        if self.engine is None:
            return {}
        stats = self.engine.stats()
        return self.routing.snapshot_payload(stats, draining=self.draining,
                                             waiting_prefill_pages=stats.waiting_prefill_pages)

    async def drain(self, target: dict) -> bool:
        """Stop (`{"draining": True}`) or resume attracting sessions; in-flight requests finish."""
        self.draining = bool(target.get("draining", True))
        return self.draining

    async def stats(self) -> EngineStats | None:
        """The engine's load now (tests and `msaserve bench` read it)."""
        return None if self.engine is None else self.engine.stats()

    async def release_session(self, session_id: str) -> list[int]:
        """The session moves away: drop its pages from this replica's prefix cache (its record in
        the KV cache service stays). Returns the page hashes dropped."""
        if self.engine is None or not self.engine.has_sessions:
            return []
        return await self.engine.call(lambda engine: engine.sessions.release(session_id))

    async def list_sessions(self) -> list[str]:
        """Ids of the sessions this replica has a record of (scoped to their tenants)."""
        return self.sessions.ids()

    async def session_info(self, session_id: str) -> SessionInfo | None:
        return self.sessions.get(session_id)

    async def delete_session(self, session_id: str) -> bool:
        """Forget the session here and, with the KV cache service on, its record there too (any
        replica can delete it: the record is the service's). True if either held it."""
        known_here = self.sessions.delete(session_id)
        if self.engine is None or not self.engine.has_sessions:
            return known_here
        in_service = await self.engine.call(lambda engine: engine.sessions.delete(session_id))
        return known_here or in_service

    async def put_response(self, key: str, record: StoredResponse) -> None:
        """Store a Responses API response (key: its tenant-scoped id; see response_store.py)."""
        self.responses.put(key, record)

    async def get_response(self, key: str) -> StoredResponse | None:
        return self.responses.get(key)

    async def delete_response(self, key: str) -> bool:
        return self.responses.delete(key)

    async def _report_loop(self) -> None:
        """Replica gauges for the dashboard: load, pages, prefix hits, tokens/s."""
        period = self.config.router.stats_period_s
        last_tokens, last_time = 0, time.perf_counter()
        idle_s = self.config.kvcache.session_idle_unpin_s
        next_unpin = time.monotonic() + max(60.0, idle_s / 10)
        while True:
            await asyncio.sleep(period)
            if self.engine is None:
                continue
            s = self.engine.stats()
            now = time.perf_counter()
            tags = {"model": self.name}
            self.metrics.set("running_requests", s.num_running, **tags)
            self.metrics.set("sparse_resident_requests", s.num_sparse_resident, **tags)
            self.metrics.set("waiting_requests", s.num_waiting, **tags)
            self.metrics.set("pages_free", s.num_free_pages, **tags)
            self.metrics.set("pages_used", s.num_total_pages - s.num_free_pages, **tags)
            self.metrics.set("prefix_hit_rate", s.prefix_hit_rate, **tags)
            rate = (self._output_tokens - last_tokens) / max(now - last_time, 1e-9)
            self.metrics.set("tokens_per_second", rate, **tags)
            last_tokens, last_time = self._output_tokens, now
            for kind, seconds in self.engine.drain_session_latencies():  # adoptions via the service
                self.metrics.observe(f"{kind}_latency_seconds", seconds, **tags)
            if self.engine.has_sessions and time.monotonic() >= next_unpin:  # idle sessions' pins go
                next_unpin = time.monotonic() + max(60.0, idle_s / 10)
                released = await self.engine.call(lambda engine: engine.sessions.unpin_idle(idle_s))
                if released:
                    logger.info("KV cache service: released the pins of %d idle sessions", released)

    async def __del__(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.engine is not None:
            await self.engine.shutdown()
