"""Traffic for the offline serving benchmark: agentic sessions and the Mooncake trace, replayed
closed-loop at a fixed concurrency through an `LLMEngine` (no HTTP, no Ray).

Sessions come from iterators, so a run bounded by a measurement window draws as many as it needs.
The window rule, the same for every backend: turns start only while the window is open; the first
engine step that ends at or after the window's end closes the run; throughput is the output tokens
streamed until then divided by the time until then; the turns still in flight are aborted and
their partial stats (TTFT, TPOT over the tokens they got) count with the finished ones.
"""

import itertools
import json
import statistics
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.types import GenerateRequest, RequestStats, SamplingParams


@dataclass
class Turn:
    prompt_ids: list[int] | np.ndarray
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
        # Ids the prompt may not hold (the tiny preset's media placeholders, ≥ vocab) become 3.
        self.context += [t if t < self.vocab else 3 for t in self.last_output]
        num_new = int(self.rng.integers(*self.append, endpoint=True))
        self.context += random_tokens(self.rng, num_new, self.vocab)
        return Turn(list(self.context), int(self.rng.integers(*self.output, endpoint=True)))


def random_tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(3, vocab, size=n).tolist()


def agentic_prefix(vocab: int, seed: int, prefix_len: int) -> list[int]:
    """The prefix (system prompt and tools) every session of `agentic_stream(…, seed, …)` shares."""
    return random_tokens(np.random.default_rng(seed), prefix_len, vocab)


def agentic_stream(vocab: int, seed: int, prefix_len: int, append: tuple[int, int], output: tuple[int, int],
                   turns: int) -> Iterator[Session]:
    """Endless sessions sharing one `prefix_len`-token prefix (system prompt and tools); each turn
    appends `append` (min, max) tokens and asks for `output` (min, max) tokens."""
    shared = agentic_prefix(vocab, seed, prefix_len)
    for s in itertools.count():
        yield AgenticSession(shared, np.random.default_rng(seed + 1 + s), vocab, append, output, turns)


def agentic_sessions(count: int, vocab: int, seed: int, prefix_len: int, append: tuple[int, int],
                     output: tuple[int, int], turns: int) -> list[Session]:
    """The first `count` sessions of `agentic_stream`."""
    return list(itertools.islice(agentic_stream(vocab, seed, prefix_len, append, output, turns), count))


def mooncake_stream(path: str, count: int | None, vocab: int, scale: int = 1, max_len: int | None = None
                    ) -> Iterator[Session]:
    """The first `count` (None: all) requests of the Mooncake trace as one-turn sessions, read
    lazily. Prompt tokens come from the hash ids: block `h` is the same 512/scale random tokens
    wherever it appears, so shared hash ids are shared prefixes. Lengths are divided by `scale`."""
    block = 512 // scale
    with open(path) as f:
        for line in itertools.islice(f, count):
            record = json.loads(line)
            length = max(1, record["input_length"] // scale)
            if max_len is not None:
                length = min(length, max_len)
            blocks = [np.random.default_rng(1_000_003 + h).integers(3, vocab, size=block)
                      for h in record["hash_ids"][: -(-length // block)]]
            tokens = np.concatenate(blocks)[:length] if blocks else np.zeros(0, dtype=np.int64)
            yield Session([Turn(tokens, max(1, record["output_length"] // scale))])


def mooncake_sessions(path: str, count: int, vocab: int, scale: int = 1, max_len: int | None = None
                      ) -> list[Session]:
    return list(mooncake_stream(path, count, vocab, scale, max_len))


@dataclass
class RunResult:
    output_tokens: int = 0
    """Output tokens streamed before the run closed (by finished and by cut requests)."""
    elapsed_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    prompt_tokens: int = 0
    requests: int = 0
    """Requests that finished inside the window."""
    requests_cut: int = 0
    """Requests in flight when the window closed (aborted; their partial stats are counted)."""
    requests_unserved: int = 0
    """Of the cut requests, those that had no first token yet (no TTFT recorded for them)."""
    selector_measurements: int = 0
    """Dense-attention keys the selector measured during the run (0 for a valid timed figure)."""

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s else 0.0

    def record(self, stats: RequestStats) -> None:
        self.prompt_tokens += stats.num_prompt_tokens
        self.cached_tokens += stats.num_cached_tokens
        if stats.ttft_s is not None:
            self.ttft_s.append(stats.ttft_s)
        if stats.tpot_s is not None:
            self.tpot_s.append(stats.tpot_s)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def run_to_end(engine: LLMEngine, prompt: list[int], max_tokens: int = 1) -> None:
    """One untimed request (e.g. to put a shared prefix in the prefix cache)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(GenerateRequest("untimed", prompt, params))
    while engine.has_unfinished():
        engine.step()


def _prompt_list(ids: list[int] | np.ndarray) -> list[int]:
    return ids if isinstance(ids, list) else ids.tolist()


def run_closed_loop(engine: LLMEngine, sessions: Iterable[Session], concurrency: int,
                    window_s: float | None = None) -> RunResult:
    """Keep `concurrency` sessions active; a session submits its next turn as soon as the previous
    one finishes, and a new session starts when one runs out of turns. Without a window, run every
    session to its end; with one, apply the window rule of this module's docstring. Times every
    request with the engine's own per-request stats."""
    source = iter(sessions)
    active: dict[str, tuple[Session, list[int]]] = {}
    result = RunResult()
    counter = itertools.count(1)
    start = time.perf_counter()
    deadline = None if window_s is None else start + window_s

    def submit(session: Session) -> bool:
        turn = session.next_turn()
        if turn is None:
            return False
        request_id = f"req{next(counter)}"
        params = SamplingParams(max_tokens=turn.max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(GenerateRequest(request_id, _prompt_list(turn.prompt_ids), params))
        active[request_id] = (session, [])
        return True

    def fill() -> None:
        while len(active) < concurrency:
            session = next(source, None)
            if session is None or not submit(session):
                return

    fill()
    while active:
        for output in engine.step():
            session, tokens = active[output.request_id]
            tokens.extend(output.token_ids)
            result.output_tokens += len(output.token_ids)
            if not output.finished:
                continue
            del active[output.request_id]
            result.requests += 1
            result.record(output.stats)
            session.last_output = tokens
            window_open = deadline is None or time.perf_counter() < deadline
            if window_open and not submit(session):
                fill()
        if deadline is not None and time.perf_counter() >= deadline:
            break
    result.elapsed_s = time.perf_counter() - start
    for request_id in list(active):
        cut = engine.abort(request_id)
        result.requests_cut += 1
        if cut is not None and cut.stats is not None:
            result.record(cut.stats)
            result.requests_unserved += cut.stats.ttft_s is None
    return result
