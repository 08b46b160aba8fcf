"""The soak's closed-loop clients, its replica killer and its RSS sampler (see soak.py).

Each of `concurrency` workers loops until told to stop: half the time a whole multi-turn session
(a script from reliability_sessions, a fresh X-Session-Id, each turn checked exactly), half
the time a one-shot request with a random prompt; streaming or not at random. A turn cut by a
retryable 503 (or a 429) is sent again 1 s later, at most MAX_ATTEMPTS times.
"""

import asyncio
import os
import random
import time
from dataclasses import dataclass, field

import httpx
import psutil
import ray
from reliability_sessions import TOKEN_RANGE, SessionScript
from soak_workload import Outcome, send

from msaserve.platform.app import APP_NAME

MAX_ATTEMPTS = 6
RECORD_WAIT_S = 3.0
"""How long a finished turn's record in the KV cache service may take to become current."""


@dataclass
class SessionResult:
    session_id: str
    started: float
    ended: float = 0.0
    turns: int = 0
    finished: bool = False
    """All turns ran (False when the soak ended first: such sessions are not judged)."""
    failure: str = ""
    """Empty for a session that continued exactly; else the first failed check."""


@dataclass
class SoakState:
    url: str
    model: str
    scripts: list[SessionScript]
    record_of: object
    """session id → token ids of its record in the KV cache service (blocking; None if absent)."""
    seed: int
    concurrency: int = 0
    stop: bool = False
    outcomes: list[Outcome] = field(default_factory=list)
    sessions: list[SessionResult] = field(default_factory=list)
    kills: list[float] = field(default_factory=list)
    rss: list[tuple[float, int, dict[str, int]]] = field(default_factory=list)
    """(time, total bytes, bytes per process kind) every RSS_PERIOD_S."""


async def worker(state: SoakState, http: httpx.AsyncClient, index: int) -> None:
    rng = random.Random(state.seed * 100_003 + index)
    n = 0
    while not state.stop:
        n += 1
        if rng.random() < 0.5:
            await run_session(state, http, rng, f"soak-{state.seed}-{index}-{n}")
        else:
            await one_shot(state, http, rng)


async def one_shot(state: SoakState, http: httpx.AsyncClient, rng: random.Random) -> None:
    prompt = [rng.randrange(*TOKEN_RANGE) for _ in range(rng.randrange(32, 160))]
    body = {"model": state.model, "prompt": prompt, "max_tokens": rng.randrange(16, 48),
            "temperature": 0.0, "ignore_eos": True, "stream": rng.random() < 0.5}  # fmt: skip
    state.outcomes.append(await send(http, state.url, body, "oneshot"))


async def run_session(state: SoakState, http: httpx.AsyncClient, rng: random.Random, sid: str) -> None:
    script = rng.choice(state.scripts)
    result = SessionResult(sid, started=time.monotonic())
    state.sessions.append(result)
    for turn, prompt in enumerate(script.prompts):
        if state.stop:
            break
        body = {"model": state.model, "prompt": prompt, "max_tokens": len(script.replies[turn]),
                "temperature": 0.0, "ignore_eos": True, "stream": rng.random() < 0.5}  # fmt: skip
        outcome = await send_with_retries(state, http, body, sid)
        result.turns = turn + 1
        expected = prompt + script.replies[turn]
        result.failure = await check_turn(state, outcome, sid, expected)
        if result.failure:
            break
    result.finished = bool(result.failure) or result.turns == len(script.prompts)
    result.ended = time.monotonic()


async def send_with_retries(state: SoakState, http: httpx.AsyncClient, body: dict, sid: str) -> Outcome:
    for _ in range(MAX_ATTEMPTS):
        outcome = await send(http, state.url, body, "session", sid)
        state.outcomes.append(outcome)
        if outcome.ok or not (outcome.retryable or outcome.status in (429, 503)):  # documented retryable
            return outcome
        await asyncio.sleep(1.0)
    return outcome


async def check_turn(state: SoakState, outcome: Outcome, sid: str, expected: list[int]) -> str:
    """The turn's exact tokens, from the session's record in the KV cache service (the reply's text
    cannot tell: the tiny byte tokenizer's text does not round-trip and depends on the prompt)."""
    if not outcome.ok:
        return f"turn failed: {outcome.error}"
    deadline = time.monotonic() + RECORD_WAIT_S
    while True:
        record = await asyncio.to_thread(state.record_of, sid)
        if record == expected:
            return ""
        if time.monotonic() > deadline:
            got = "none" if record is None else f"{len(record)} ids, differs at {_diff(record, expected)}"
            return f"KV cache record != reference conversation ({got}, expected {len(expected)})"
        await asyncio.sleep(0.1)


def _diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


# ---- faults ------------------------------------------------------------------------------------
def model_replica_names() -> list[str]:
    prefix = f"SERVE_REPLICA::{APP_NAME}#Model#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(prefix))  # fmt: skip


async def killer(state: SoakState, first_at: float, every_s: float, log) -> None:
    """Kill one model replica (ray.kill, no_restart=False: Serve replaces it) at first_at, then
    every every_s seconds, until the soak stops."""
    rng = random.Random(state.seed)
    at = first_at
    while not state.stop:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        if state.stop:
            return
        names = await asyncio.to_thread(model_replica_names)
        if not names:
            log("kill: no model replica found")
        else:
            victim = rng.choice(names)
            handle = await asyncio.to_thread(ray.get_actor, victim, "serve")
            ray.kill(handle, no_restart=False)
            state.kills.append(time.monotonic())
            log(f"kill: {victim.rsplit('#', 1)[1]} (of {len(names)} replicas)")
        at += every_s


# ---- memory ------------------------------------------------------------------------------------
RSS_PERIOD_S = 10.0


def process_kind(p: psutil.Process) -> str:
    try:
        argv0 = (p.cmdline() or [p.name()])[0]
    except psutil.Error:
        return "gone"
    if p.pid == os.getpid():
        return "driver"
    if argv0.startswith("ray::"):  # ray::<actor class>.<method running now>
        return argv0.split()[0].split(".")[0]
    return os.path.basename(argv0)


def sample_rss() -> tuple[int, dict[str, int]]:
    """RSS of this process and every descendant (gcs_server, raylet, Ray workers: replicas, shards)."""
    me = psutil.Process()
    by_kind: dict[str, int] = {}
    for p in [me, *me.children(recursive=True)]:
        try:
            rss = p.memory_info().rss
        except psutil.Error:
            continue
        kind = process_kind(p)
        by_kind[kind] = by_kind.get(kind, 0) + rss
    return sum(by_kind.values()), by_kind


async def rss_sampler(state: SoakState) -> None:
    while not state.stop:
        total, by_kind = await asyncio.to_thread(sample_rss)
        state.rss.append((time.monotonic(), total, by_kind))
        await asyncio.sleep(RSS_PERIOD_S)
