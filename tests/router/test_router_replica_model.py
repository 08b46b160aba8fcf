"""The routing simulator's replica (benchmarks/router/replica_model.py) admits like the engine's
scheduler (`Scheduler._admit_waiting`): a waiting request is admitted only while the step's token
budget has room after the running prefills, so a backlog holds no pages and evicts no cached prefix
before it is prefilled (issue 29: the simulator admitted every request whose pages fit, and a burst
evicted every cached prefix)."""

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "router"))

from replica_model import Calibration, SimReplica, SimRequest

PAGE = 512


def _cal() -> Calibration:
    return dataclasses.replace(Calibration.default(), chunk_tokens=4 * PAGE, page_tokens=PAGE)


def _request(i: int, blocks: list[int], output_tokens: int = 2) -> SimRequest:
    req = SimRequest(i, 0.0, len(blocks) * PAGE, output_tokens, blocks)
    req.out_pages = 1
    return req


def test_backlog_waits_without_pages_and_keeps_the_cached_prefix() -> None:
    replica = SimReplica("r0", _cal(), capacity=40)
    replica.waiting.append(_request(0, [1, 2, 3, 4]))
    replica.advance(10.0)  # prefilled and finished: pages 1-4 are cached, unreferenced
    assert list(replica.cache) == [1, 2, 3, 4]
    # A backlog of 8 prompts of 8 pages each: 64 pages wanted, 40 exist.
    for i in range(8):
        replica.waiting.append(_request(1 + i, [100 + 10 * i + j for j in range(8)]))
    assert replica.step(until=20.0)
    # Only what the step's 4-page budget reaches is admitted (the first prompt, 8 pages + 1 output).
    assert len(replica.prefilling) == 1 and len(replica.waiting) == 7
    assert replica.private_pages == 9
    assert all(h in replica.cache for h in (1, 2, 3, 4)), "a waiting request evicted a cached prefix"


def test_admission_follows_the_budget_left_by_running_prefills() -> None:
    replica = SimReplica("r0", _cal(), capacity=100)
    for i in range(3):
        replica.waiting.append(_request(i, [10 * i + j for j in range(2)]))  # 2 pages = 1,024 tokens
    replica._admit()
    # 4-page budget: the first two (2 + 2 pages) use it up; the third waits for the next step.
    assert [r.request_id for r in replica.prefilling] == [0, 1]
    assert [r.request_id for r in replica.waiting] == [2]
    replica.advance(100.0)
    assert not (replica.waiting or replica.prefilling or replica.decoding)
    assert replica.private_pages == 0 and replica.referenced == 0
