"""Issue 26, item 6: a 429 queue_full's Retry-After comes from the measured drain rate (it was always
1 s, however long the queue)."""

import asyncio

import pytest
from inprocess_app import inprocess_gateway

from msaserve.engine.types import GenerateRequest, SamplingParams
from msaserve.platform.drain_rate import NO_DATA_RETRY_AFTER_S, DrainRate

MODEL = "msaserve/tiny"
ONE_SLOT = {
    "model": {"spec": "tiny"},
    "engine": {"max_num_seqs": 1, "max_waiting": 1, "max_model_len": 512},
}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_drain_rate_over_the_window() -> None:
    clock = FakeClock()
    drain = DrainRate(window_s=60.0, clock=clock)
    assert drain.rate() is None and drain.retry_after_s(10) == NO_DATA_RETRY_AFTER_S
    for _ in range(6):
        drain.note_finished()
    clock.now += 30.0
    assert drain.rate() == pytest.approx(6 / 30)
    assert drain.retry_after_s(9) == pytest.approx(10 / (6 / 30))  # 9 ahead + this one, at 0.2/s
    clock.now += 61.0  # all six leave the window
    assert drain.rate() is None


def test_queue_full_retry_after_follows_the_drain_rate() -> None:
    clock = FakeClock()

    def long_request(i: int) -> GenerateRequest:
        sampling = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0)
        return GenerateRequest(request_id=f"long-{i}", prompt_token_ids=[5, 6, 7], sampling=sampling)

    async def go(client, ctx):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        for _ in range(3):  # three requests finish at t=1000 ...
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        clock.now += 30.0  # ... and 30 s later the measured rate is 3 / 30 s
        streams = [gateway.deployment.generate(long_request(i)) for i in range(2)]
        first = await streams[0].__anext__()  # one running
        pending = streams[1].__anext__()  # one waiting (its first output comes after the first's end)
        waiter = asyncio.ensure_future(pending)
        await asyncio.sleep(0.2)
        response = await client.post("/v1/chat/completions", json=body)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
        return first, response

    with inprocess_gateway(ONE_SLOT) as gateway:
        gateway.deployment.drain_rate = DrainRate(clock=clock)
        first, response = gateway.run(go)
    assert not first.finished
    assert response.status_code == 429, response.text
    assert response.json()["error"]["code"] == "queue_full"
    # 1 waiting + this request, at 0.1 requests/s: 20 s (it was "1" whatever the queue).
    assert response.headers["retry-after"] == "20"
