"""Traffic for the offline serving benchmark: agentic sessions and the Mooncake trace, replayed
closed-loop at a fixed concurrency through an `LLMEngine` (no HTTP, no Ray)."""

import json
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.types import GenerateRequest, SamplingParams


@dataclass
class Turn:
    prompt_ids: list[int]
    max_tokens: int


class Session:
    """A conversation whose turns are submitted one after another; `last_output` is set by the
    driver when a turn finishes."""

    def __init__(self, turns: list[Turn]) -> None:
        self._turns = deque(turns)
        self.last_output: list[int] = []

    def next_turn(self) -> Turn | None:
        return self._turns.popleft() if self._turns else None


class AgenticSession(Session):
    """Each turn's prompt is the previous prompt + the model's answer + `append` new tokens, so
    everything but the new tokens can come from the prefix cache."""

    def __init__(self, shared: list[int], rng: np.random.Generator, vocab: int, append: tuple[int, int],
                 output: tuple[int, int], turns: int) -> None:
        super().__init__([])
        self.context = list(shared)
        self.rng, self.vocab, self.append, self.output = rng, vocab, append, output
        self.turns_left = turns

    def next_turn(self) -> Turn | None:
        if self.turns_left == 0:
            return None
        self.turns_left -= 1
        self.context += self.last_output
        num_new = int(self.rng.integers(*self.append, endpoint=True))
        self.context += random_tokens(self.rng, num_new, self.vocab)
        return Turn(list(self.context), int(self.rng.integers(*self.output, endpoint=True)))


def random_tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(3, vocab, size=n).tolist()


def agentic_sessions(count: int, vocab: int, seed: int, prefix_len: int, append: tuple[int, int],
                     output: tuple[int, int], turns: int) -> list[Session]:
    """`count` sessions sharing one `prefix_len`-token prefix (system prompt and tools); each turn
    appends `append` (min, max) tokens and asks for `output` (min, max) tokens."""
    shared = random_tokens(np.random.default_rng(seed), prefix_len, vocab)
    return [
        AgenticSession(shared, np.random.default_rng(seed + 1 + s), vocab, append, output, turns)
        for s in range(count)
    ]


def mooncake_sessions(path: str, count: int, vocab: int, scale: int = 1, max_len: int | None = None
                      ) -> list[Session]:
    """The first `count` requests of the Mooncake trace as one-turn sessions. Prompt tokens come
    from the hash ids: block `h` is the same 512/scale random tokens wherever it appears, so
    shared hash ids are shared prefixes. Lengths are divided by `scale` (for CPU runs)."""
    block = 512 // scale
    sessions = []
    with open(path) as f:
        for line, _ in zip(f, range(count), strict=False):
            record = json.loads(line)
            tokens: list[int] = []
            for h in record["hash_ids"]:
                tokens += random_tokens(np.random.default_rng(1_000_003 + h), block, vocab)
            length = max(1, record["input_length"] // scale)
            if max_len is not None:
                length = min(length, max_len)
            turn = Turn(tokens[:length], max(1, record["output_length"] // scale))
            sessions.append(Session([turn]))
    return sessions


@dataclass
class RunResult:
    output_tokens: int = 0
    elapsed_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    prompt_tokens: int = 0
    requests: int = 0

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s else 0.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def run_closed_loop(engine: LLMEngine, sessions: list[Session], concurrency: int) -> RunResult:
    """Keep `concurrency` sessions active; a session submits its next turn as soon as the previous
    one finishes. Times every request with the engine's own per-request stats."""
    queue = deque(sessions)
    active: dict[str, tuple[Session, list[int]]] = {}
    result = RunResult()
    counter = 0

    def submit(session: Session) -> bool:
        nonlocal counter
        turn = session.next_turn()
        if turn is None:
            return False
        counter += 1
        request_id = f"req{counter}"
        params = SamplingParams(max_tokens=turn.max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(GenerateRequest(request_id, turn.prompt_ids, params))
        active[request_id] = (session, [])
        return True

    start = time.perf_counter()
    while queue or active:
        while queue and len(active) < concurrency:
            submit(queue.popleft())
        for output in engine.step():
            session, tokens = active[output.request_id]
            tokens.extend(output.token_ids)
            if not output.finished:
                continue
            del active[output.request_id]
            stats = output.stats
            result.requests += 1
            result.output_tokens += stats.num_output_tokens
            result.prompt_tokens += stats.num_prompt_tokens
            result.cached_tokens += stats.num_cached_tokens
            if stats.ttft_s is not None:
                result.ttft_s.append(stats.ttft_s)
            if stats.tpot_s is not None:
                result.tpot_s.append(stats.tpot_s)
            session.last_output = tokens
            if not submit(session) and queue:
                submit(queue.popleft())
    result.elapsed_s = time.perf_counter() - start
    return result
