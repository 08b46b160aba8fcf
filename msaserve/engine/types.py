"""Messages between the engine and its callers (the model deployment, tests, benchmarks).

The engine produces these; callers never see the scheduler's or block manager's internals.
"""

import math
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]

# The longest repr of a rejected value an error message quotes: a 100 KB stop string or schema is
# named by its start and its length, not echoed back in full.
MAX_QUOTED_CHARS = 200


def quoted(value: object, limit: int = MAX_QUOTED_CHARS) -> str:
    """repr(value), cut to `limit` characters with its full length named when longer."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text):,} characters)"


class EngineError(Exception):
    """Base of the errors the engine reports to callers; `status` is the HTTP status to use."""

    status: int = 500


class InvalidParameter(EngineError, ValueError):
    """A request parameter outside its allowed range; the message names it and the range."""

    status = 400

    def __init__(self, param: str, value: object, allowed: str) -> None:
        super().__init__(f"{param}={quoted(value)} is invalid: allowed {allowed}")
        self.param = param
        self.value = value
        self.allowed = allowed


class ContextTooLong(EngineError, ValueError):
    """Prompt plus requested output exceed the model's context."""

    status = 400

    def __init__(self, prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
        super().__init__(
            f"this model's maximum context length is {max_model_len} tokens; the request has "
            f"{prompt_tokens} prompt tokens and asks for {max_tokens} output tokens"
        )
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


class QueueFull(EngineError):
    """The waiting queue is at its bound; retry after `retry_after_s`."""

    status = 429

    def __init__(self, waiting: int, limit: int, retry_after_s: float = 1.0) -> None:
        super().__init__(f"{waiting} requests are waiting (limit {limit}); retry later")
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on the output (`msaserve.engine.structured`): `source` is the JSON schema text
    (json_schema), a regex or a Lark grammar; empty for json_object (any JSON object)."""

    kind: Literal["json_object", "json_schema", "regex", "lark"]
    source: str = ""
    strict: bool = True
    """json_schema only: False ignores keywords the library does not enforce instead of refusing."""
    param: str = "response_format"
    """The request field an uncompilable grammar is reported against."""
    shown: str = ""
    """What the client wrote, quoted in that report in place of `source` (which may hold what the server
    added: JSON layout keywords, the tool-call wrapper); empty: `source`."""


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. `validate()` names any parameter out of range."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    """Alternatives per position, 0–20; needs logprobs=True."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already in the output (OpenAI), -2 to 2."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence in the output (OpenAI), -2 to 2."""
    repetition_penalty: float = 1.0
    """Prompt and output tokens' logits divided (positive) or multiplied (negative) by it; 1 = off."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p × the top token's; 0 = off."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Token id → added to its logit, -100 to 100 (OpenAI)."""
    grammar: GrammarSpec | None = None
    """Constrain the output to this grammar (structured outputs, enforced tool calls)."""

    def validate(self) -> "SamplingParams":
        checks: list[tuple[str, object, bool, str]] = [
            ("max_tokens", self.max_tokens, self.max_tokens >= 1, "an integer ≥ 1"),
            ("temperature", self.temperature,
             math.isfinite(self.temperature) and 0.0 <= self.temperature <= 2.0, "0.0 to 2.0"),
            ("top_p", self.top_p, math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0,
             "greater than 0.0 and at most 1.0"),
            ("top_k", self.top_k, self.top_k >= 0, "0 (off) or a positive integer"),
            ("seed", self.seed, self.seed is None or 0 <= self.seed < 2**63,
             "an integer from 0 to 2^63-1"),
            ("stop", self.stop, len(self.stop) <= 16 and all(0 < len(s) <= 256 for s in self.stop),
             "at most 16 non-empty strings of at most 256 characters"),
            ("stop_token_ids", self.stop_token_ids,
             len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS and all(t >= 0 for t in self.stop_token_ids),
             f"at most {MAX_STOP_TOKEN_IDS} token ids, each ≥ 0"),
            ("top_logprobs", self.top_logprobs, 0 <= self.top_logprobs <= 20, "0 to 20"),
            ("presence_penalty", self.presence_penalty, _within(self.presence_penalty, -2.0, 2.0),
             "-2.0 to 2.0"),
            ("frequency_penalty", self.frequency_penalty, _within(self.frequency_penalty, -2.0, 2.0),
             "-2.0 to 2.0"),
            ("repetition_penalty", self.repetition_penalty,
             _within(self.repetition_penalty, 0.0, 2.0) and self.repetition_penalty > 0.0,
             "greater than 0.0 and at most 2.0 (1.0 = off)"),
            ("min_p", self.min_p, _within(self.min_p, 0.0, 1.0), "0.0 to 1.0"),
            ("logit_bias", self.logit_bias,
             len(self.logit_bias) <= 300 and all(_within(v, -100.0, 100.0) for v in self.logit_bias.values()),
             "at most 300 token ids, each with a bias from -100 to 100"),
        ]
        for name, value, ok, allowed in checks:
            if not ok:
                raise InvalidParameter(name, value, allowed)
        if self.top_logprobs and not self.logprobs:
            raise InvalidParameter("top_logprobs", self.top_logprobs, "0 unless logprobs is true")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Penalties or logit_bias change this request's logits."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    @property
    def processes_logits(self) -> bool:
        """True when the logits change before sampling (penalties, bias, grammar): such requests
        need the host's view of the previous token before the next step's logits are final, so
        they never run multi-step decode rounds."""
        return self.penalized or self.grammar is not None


MAX_STOP_TOKEN_IDS = 64


def _within(value: float, low: float, high: float) -> bool:
    return math.isfinite(value) and low <= value <= high


@dataclass
class GenerateRequest:
    """One generation: token ids in (the caller applied the chat template), tokens out."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    session_id: str | None = None
    """Keeps this conversation's pages cached (and, with the KV cache service, persisted)."""
    media: list[object] = field(default_factory=list)
    """Preprocessed media items (patches, grid, content hash), in prompt order."""
    arrival_time: float | None = None
    cache_salt: int = 0
    """Root of the request's page-hash chain (`kvcache.page_hash.tenant_root`): 0 shares prefix-cache
    pages with every request; the gateway sets its tenant's root so that pages (and the timing of
    a hit on them) stay within the tenant."""


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestStats:
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens whose pages came from the prefix cache (not recomputed)."""
    num_output_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    """Mean time per output token after the first."""
    num_pages: int = 0
    num_preemptions: int = 0


@dataclass
class GenerateOutput:
    """One streamed increment of a request. The last one has finished=True and stats."""

    request_id: str
    text: str
    """New text since the previous output (incremental detokenization)."""
    token_ids: list[int]
    """New token ids since the previous output."""
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    stats: RequestStats | None = None


@dataclass
class EngineStats:
    """Load as the router and metrics see it."""

    num_running: int
    num_waiting: int
    num_free_pages: int
    num_total_pages: int
    num_cached_pages: int = 0
    prefix_hit_rate: float = 0.0
    num_sparse_resident: int = 0
    """Of the running requests, those decoding sparse-resident, off the pool (`kv/resident_lane.py`)."""
    sparse_resident_total: int = 0
    """Requests moved or adopted into the sparse-resident lane since the engine started."""
    waiting_prefill_pages: int = 0
    """Pages of prompt still to prefill (`Scheduler.prefill_tokens_left`, in pages): the work ahead
    of a new request, which the router prices (`RouterState.queued_prefill_pages`)."""


@dataclass
class KVEvent:
    """Page hashes a replica gained or lost, for the router's view of where prefixes live."""

    kind: Literal["stored", "removed", "cleared"]
    page_hashes: list[int]
    timestamp: float = 0.0
