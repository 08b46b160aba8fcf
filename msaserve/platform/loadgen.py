"""Load generation for `msaserve bench`: closed-loop concurrency levels, or trace replay.

Prompts are token ids sent to /v1/completions, so their lengths are exact and requests that share
a trace's 512-token prefix blocks (`hash_ids`) share real token prefixes, which the prefix cache
and router see as such. Every request streams with usage, so TTFT is the first text chunk's arrival
and TPOT is (last − first) / (output tokens − 1).
"""

import asyncio
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

TRACE_BLOCK_TOKENS = 512
TOKEN_ID_RANGE = (3, 250)
"""Ids valid in every bundled tokenizer (the tiny preset's has 259)."""


@dataclass
class RequestSpec:
    prompt_token_ids: list[int]
    max_tokens: int
    send_at_s: float = 0.0
    """Trace replay: offset from the start at which to send."""


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass
class LevelResult:
    label: str
    wall_s: float
    results: list[RequestResult] = field(default_factory=list)

    def summary(self) -> dict:
        ok = [r for r in self.results if r.ok]
        tpots = [t for r in ok if (t := r.tpot_s) is not None]
        out_tokens = sum(r.output_tokens for r in ok)
        return {
            "label": self.label,
            "requests": len(self.results),
            "failed": len(self.results) - len(ok),
            "ttft_p50_s": percentile([r.ttft_s for r in ok], 50),
            "ttft_p99_s": percentile([r.ttft_s for r in ok], 99),
            "tpot_p50_s": percentile(tpots, 50),
            "tpot_p99_s": percentile(tpots, 99),
            "e2e_p50_s": percentile([r.e2e_s for r in ok], 50),
            "output_tokens_per_s": out_tokens / self.wall_s if self.wall_s > 0 else 0.0,
            "requests_per_s": len(ok) / self.wall_s if self.wall_s > 0 else 0.0,
        }


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def synthetic_requests(n: int, prompt_tokens: int, max_tokens: int, seed: int = 0) -> list[RequestSpec]:
    rng = random.Random(seed)
    return [
        RequestSpec([rng.randrange(*TOKEN_ID_RANGE) for _ in range(prompt_tokens)], max_tokens)
        for _ in range(n)
    ]


def _block_tokens(hash_id: int) -> list[int]:
    rng = random.Random(hash_id)
    return [rng.randrange(*TOKEN_ID_RANGE) for _ in range(TRACE_BLOCK_TOKENS)]


def trace_requests(
    path: Path, limit: int, max_input: int, max_output: int, time_scale: float
) -> list[RequestSpec]:
    """Mooncake-format JSONL (timestamp ms, input_length, output_length, hash_ids), lengths capped."""
    specs: list[RequestSpec] = []
    first_ts: float | None = None
    with open(path) as f:
        for line in f:
            if len(specs) >= limit:
                break
            row = json.loads(line)
            first_ts = row["timestamp"] if first_ts is None else first_ts
            tokens = [t for h in row["hash_ids"] for t in _block_tokens(h)]
            length = min(row["input_length"], max_input)
            tokens = (tokens + _block_tokens(-len(specs) - 1))[:length]
            send_at = (row["timestamp"] - first_ts) / 1000.0 * time_scale
            specs.append(RequestSpec(tokens, max(1, min(row["output_length"], max_output)), send_at))
    return specs


async def one_request(client, model: str, spec: RequestSpec) -> RequestResult:
    start = time.perf_counter()
    first = None
    result = RequestResult(ok=False)
    try:
        stream = await client.completions.create(
            model=model, prompt=spec.prompt_token_ids, max_tokens=spec.max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter()
            if chunk.usage:
                result.output_tokens = chunk.usage.completion_tokens
                result.prompt_tokens = chunk.usage.prompt_tokens
    except Exception as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    end = time.perf_counter()
    result.ok = True
    result.ttft_s = (first or end) - start
    result.e2e_s = end - start
    return result


async def run_closed_loop(
    client, model: str, specs: list[RequestSpec], concurrency: int, label: str, on_done: Callable[[], None]
) -> LevelResult:
    queue = list(reversed(specs))
    level = LevelResult(label=label, wall_s=0.0)

    async def worker() -> None:
        while queue:
            level.results.append(await one_request(client, model, queue.pop()))
            on_done()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    level.wall_s = time.perf_counter() - start
    return level


async def run_trace(
    client, model: str, specs: list[RequestSpec], label: str, on_done: Callable[[], None]
) -> LevelResult:
    level = LevelResult(label=label, wall_s=0.0)
    start = time.perf_counter()

    async def timed(spec: RequestSpec) -> None:
        await asyncio.sleep(max(0.0, spec.send_at_s - (time.perf_counter() - start)))
        level.results.append(await one_request(client, model, spec))
        on_done()

    await asyncio.gather(*(timed(s) for s in specs))
    level.wall_s = time.perf_counter() - start
    return level
