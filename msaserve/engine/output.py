"""Turning sampled tokens into streamed outputs: stop conditions, text deltas, per-request stats."""

import time

from msaserve.engine.detokenizer import Decoder, IncrementalDetokenizer, StopStringMatcher
from msaserve.engine.sequence import Sequence
from msaserve.engine.types import FinishReason, GenerateOutput, RequestStats, TokenLogprob


class RequestOutputTracker:
    """Follows one request from its first to its last token."""

    def __init__(self, seq: Sequence, tokenizer: Decoder | None, eos_token_ids: set[int],
                 max_model_len: int) -> None:
        self.seq = seq
        self.detokenizer = IncrementalDetokenizer(tokenizer, seq.token_ids) if tokenizer else None
        self.stop_strings = StopStringMatcher(seq.sampling.stop)
        stop_ids = set(seq.sampling.stop_token_ids)
        if not seq.sampling.ignore_eos:
            stop_ids |= eos_token_ids
        self.stop_token_ids = stop_ids
        self.max_model_len = max_model_len

    def on_token(self, token_id: int, logprob: TokenLogprob | None, now: float) -> GenerateOutput:
        """Record a sampled token (already appended to seq.token_ids) and build its output."""
        seq = self.seq
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        text, reason = self._text_and_reason(token_id)
        if reason is None and seq.num_output_tokens >= seq.sampling.max_tokens:
            reason = "length"
        if reason is None and seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None and reason != "stop":
            text += self._flush()
        seq.finish_reason = reason
        return GenerateOutput(
            request_id=seq.request_id, text=text, token_ids=[token_id], finished=reason is not None,
            finish_reason=reason, logprobs=[logprob] if logprob is not None else None,
            stats=self.stats() if reason is not None else None,
        )

    def _text_and_reason(self, token_id: int) -> tuple[str, FinishReason | None]:
        if token_id in self.stop_token_ids:
            return self._flush(), "stop"  # the stop token's own text is not part of the output
        if self.detokenizer is None:
            return "", None
        text, matched = self.stop_strings.feed(self.detokenizer.add(token_id))
        return text, "stop" if matched else None

    def _flush(self) -> str:
        if self.detokenizer is None:
            return ""
        text, matched = self.stop_strings.feed(self.detokenizer.flush())
        return text if matched else text + self.stop_strings.flush()

    def finish_without_token(self, reason: FinishReason) -> GenerateOutput:
        """The last output of a request that ends between tokens (abort or error)."""
        self.seq.finish_reason = reason
        return GenerateOutput(
            request_id=self.seq.request_id, text="", token_ids=[], finished=True,
            finish_reason=reason, stats=self.stats(),
        )

    def stats(self) -> RequestStats:
        seq = self.seq
        ttft = tpot = None
        if seq.first_token_time is not None:
            ttft = seq.first_token_time - seq.arrival_time
            if seq.num_output_tokens > 1 and seq.last_token_time is not None:
                tpot = (seq.last_token_time - seq.first_token_time) / (seq.num_output_tokens - 1)
        return RequestStats(
            num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens, ttft_s=ttft, tpot_s=tpot,
            num_pages=max(len(seq.block_table), seq.swapped_pages),
            num_preemptions=seq.num_preemptions,
        )


def now() -> float:
    return time.time()
