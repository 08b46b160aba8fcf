"""`n` > 1: one engine request per choice, the prompt prefilled once.

The first choice is started alone; `start_generation` returns after its first token, when its
prompt's full pages are in the block manager's prefix cache, so the other n − 1 choices, started
then all together, reuse those pages and prefill only the last partial page. Each of those calls
gets a Serve internal request id of its own (`serve_calls.py`): with the HTTP request's id shared,
Serve's router left all but one of them waiting for a replica forever. Each choice gets its own request id
(`<id>-<i>`) and, when the client set `seed`, the seed `seed + i`, so the same request gives the
same n choices again while the choices differ from one another.
"""

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from msaserve.engine.types import GenerateOutput, GenerateRequest
from msaserve.platform.errors import bad_parameter
from msaserve.platform.generation import Generation, start_generation, usage_of
from msaserve.platform.openai_types import Usage


def choice_request(request: GenerateRequest, index: int) -> GenerateRequest:
    if index == 0:
        return request
    seed = request.sampling.seed
    sampling = replace(request.sampling, seed=None if seed is None else (seed + index) % 2**63)
    return replace(request, request_id=f"{request.request_id}-{index}", sampling=sampling)


async def start_choices(ctx: Any, request: GenerateRequest, n: int) -> list[Generation]:
    """n started generations (each past its first token); all are closed if one fails to start."""
    if n > 1 and request.session_id:
        raise bad_parameter("n", n, "1 for a request with a session (one conversation, one reply)")
    first = await start_generation(ctx, request)
    if n == 1:
        return [first]
    results = await asyncio.gather(
        *(start_generation(ctx, choice_request(request, i), own_call_id=True) for i in range(1, n)),
        return_exceptions=True,
    )
    started = [first] + [r for r in results if isinstance(r, Generation)]
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is not None:
        for gen in started:
            gen.close()
        raise failure
    return started


async def merged(gens: list[Generation]) -> AsyncIterator[tuple[int, GenerateOutput]]:
    """(choice index, output) from all choices as they arrive; closes every choice on exit."""
    if len(gens) == 1:
        async for out in gens[0].outputs():
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, gen: Generation) -> None:
        try:
            async for out in gen.outputs():
                await queue.put((index, out))
        except BaseException as error:  # delivered to the reader
            await queue.put((index, error))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(gens)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for gen in gens:
            gen.close()


def total_usage(gens: list[Generation]) -> Usage:
    """The prompt counted once (as OpenAI does); completions and cached prompt tokens summed."""
    parts = [usage_of(g.final_stats, len(g.request.prompt_token_ids), g.num_output_tokens) for g in gens]
    completion = sum(p.completion_tokens for p in parts)
    cached = sum((p.prompt_tokens_details or {}).get("cached_tokens", 0) for p in parts)
    prompt = parts[0].prompt_tokens
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details={"cached_tokens": cached})
