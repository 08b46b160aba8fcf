"""AsyncEngine: streaming, errors before the first output, cancellation that frees pages."""

import asyncio

import pytest
import reference_decode
from engine_helpers import greedy, random_prompt

from msaserve.engine.async_engine import AsyncEngine
from msaserve.engine.config import EngineConfig
from msaserve.engine.types import ContextTooLong, GenerateRequest, InvalidParameter, QueueFull, SamplingParams


def make_async(model, tokenizer, **overrides) -> AsyncEngine:
    settings = dict(model="tiny", num_pages=64, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512)
    settings.update(overrides)
    return AsyncEngine(EngineConfig(**settings), model=model, tokenizer=tokenizer)


async def consume(engine: AsyncEngine, request: GenerateRequest) -> list:
    return [output async for output in engine.generate(request)]


@pytest.mark.parametrize("decode_steps", [1, 8])
def test_concurrent_streams_match_the_reference(tiny_model, tiny_tokenizer, decode_steps):
    """decode_steps=8: the streams decode in rounds, each step's tokens handed out as it ends."""
    prompts = [random_prompt(n, seed=n) for n in (90, 17, 70)]
    want = [reference_decode.generate(tiny_model, p, 10) for p in prompts]

    async def main():
        engine = make_async(tiny_model, tiny_tokenizer, decode_steps=decode_steps)
        await engine.start()
        try:
            results = await asyncio.gather(*(
                consume(engine, GenerateRequest(f"r{i}", p, greedy(10))) for i, p in enumerate(prompts)
            ))
        finally:
            await engine.shutdown()
        return engine, results

    engine, results = asyncio.run(main())
    for outputs, expected in zip(results, want, strict=True):
        assert [t for o in outputs for t in o.token_ids] == expected
        assert outputs[-1].finished and outputs[-1].finish_reason == "length"
        assert sum(o.finished for o in outputs) == 1
    assert engine.stats().num_free_pages == 64
    assert any(e.kind == "stored" for e in engine.drain_kv_events())


def test_errors_are_raised_before_the_first_output(tiny_model, tiny_tokenizer):
    async def main():
        engine = make_async(tiny_model, tiny_tokenizer, max_waiting=1)
        try:
            with pytest.raises(InvalidParameter, match="top_p"):
                await consume(engine, GenerateRequest("a", [5], SamplingParams(top_p=2.0)))
            with pytest.raises(ContextTooLong):
                await consume(engine, GenerateRequest("b", [5] * 500, SamplingParams(max_tokens=20)))
            # Fill the one waiting slot, then the next request is refused with 429.
            first = engine.generate(GenerateRequest("c", [5] * 10, greedy(200)))
            await first.__anext__()
            second = engine.generate(GenerateRequest("d", [6] * 10, greedy(5)))
            third = engine.generate(GenerateRequest("e", [7] * 10, greedy(5)))
            pending = asyncio.ensure_future(second.__anext__())
            await asyncio.sleep(0)
            with pytest.raises(QueueFull) as error:
                await third.__anext__()
            assert error.value.status == 429
            await first.aclose()
            await pending
            await second.aclose()
        finally:
            await engine.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("decode_steps", [1, 8])
def test_cancelling_a_consumer_aborts_and_frees_its_pages(tiny_model, tiny_tokenizer, decode_steps):
    """decode_steps=8: the abort reaches the engine between two steps of a round."""
    async def wait_until_idle(engine: AsyncEngine) -> None:
        for _ in range(500):
            stats = engine.stats()
            if stats.num_running == 0 and stats.num_free_pages == 64 and not engine.engine.trackers:
                return
            await asyncio.sleep(0.01)

    async def main():
        engine = make_async(tiny_model, tiny_tokenizer, decode_steps=decode_steps)
        stream = engine.generate(GenerateRequest("long", random_prompt(120, seed=1), greedy(300)))
        first = await stream.__anext__()
        assert first.token_ids and engine.stats().num_free_pages < 64
        seq = engine.engine.trackers["long"].seq
        await stream.aclose()  # the client disconnected
        await wait_until_idle(engine)
        assert engine.stats().num_free_pages == 64
        assert seq.finish_reason == "abort" and seq.num_output_tokens < 300
        # A task cancelled mid-stream aborts as well.
        task = asyncio.ensure_future(consume(engine, GenerateRequest("t", [9] * 40, greedy(300))))
        while "t" not in engine.engine.trackers or not engine.engine.trackers["t"].seq.num_output_tokens:
            await asyncio.sleep(0.005)
        seq = engine.engine.trackers["t"].seq
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until_idle(engine)
        assert engine.stats().num_free_pages == 64
        assert seq.finish_reason == "abort" and seq.num_output_tokens < 300
        await engine.shutdown()

    asyncio.run(main())
