"""Readiness: a model replica answered a 1-token probe within `http.ready_probe_timeout_s`.

`/health` is liveness (the gateway's event loop answers); it said 200 while the only model replica
was dead, because it asked the gateway's cached model info, not a replica. `/ready` sends a real
1-token greedy generation through the same handle and router as client requests; a success is
reused for `http.ready_cache_s` so that a load balancer polling every second costs one probe per
period, and concurrent polls share one probe.
"""

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from msaserve.engine.types import GenerateRequest, SamplingParams
from msaserve.platform.errors import APIError
from msaserve.platform.generation import start_generation

PROBE_TEXT = "ready?"
_probe_ids = itertools.count()


@dataclass
class ProbeResult:
    latency_s: float
    checked_at: float
    """clock() when the probe answered."""


class ReadinessProbe:
    def __init__(self, timeout_s: float, cache_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s, self.cache_s, self.clock = timeout_s, cache_s, clock
        self._last: ProbeResult | None = None
        self._lock = asyncio.Lock()

    async def check(self, ctx: Any) -> ProbeResult:
        """The last success if recent, else a new probe; APIError 503 when no replica answers."""
        async with self._lock:
            if self._last is not None and self.clock() - self._last.checked_at < self.cache_s:
                return self._last
            self._last = None
            start = self.clock()
            try:
                await asyncio.wait_for(self._probe(ctx), self.timeout_s)
            except TimeoutError:
                raise APIError(
                    503,
                    f"no model replica answered a 1-token probe within http.ready_probe_timeout_s="
                    f"{self.timeout_s:g}s",
                    code="probe_timeout",
                    retry_after_s=self.timeout_s,
                ) from None
            except APIError as e:
                if e.status < 500 and e.status != 429:
                    raise APIError(503, f"the 1-token readiness probe was refused: {e.message}",
                                   code="probe_failed", retry_after_s=1.0) from None
                raise APIError(503, f"the 1-token readiness probe failed: {e.message}",
                               code=e.code or "probe_failed", retry_after_s=e.retry_after_s or 1.0) from None
            self._last = ProbeResult(self.clock() - start, self.clock())
            return self._last

    async def _probe(self, ctx: Any) -> None:
        info = await ctx.require_ready()  # 503 warming_up / model_failed as they are
        ids = list(info.tokenizer.encode(PROBE_TEXT))[:8] or [0]
        request = GenerateRequest(
            request_id=f"ready-probe-{next(_probe_ids)}-{time.time_ns()}",
            prompt_token_ids=ids,
            sampling=SamplingParams(max_tokens=1, temperature=0.0),
        )
        generation = await start_generation(ctx, request)
        async for _ in generation.outputs():
            pass
