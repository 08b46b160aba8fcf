"""Incremental detokenization and stop strings: text deltas that are safe to stream.

Decoding one token at a time is wrong for byte-level BPE (a character can span tokens, and a
token's leading space depends on its neighbours), so each delta is the difference between the
decoding of a short window of tokens with and without the new ones, and nothing is released
while it ends in an incomplete character. Stop strings are matched on the text; a suffix that may
still grow into a stop string is held back until it either completes (and is cut) or cannot.
"""

from typing import Protocol

# Tokens of context before the unreleased ones; enough for any merge at the window's start.
_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def add(self, token_id: int) -> str:
        """Append one output token; return the text it completes (may be empty)."""
        self.token_ids.append(token_id)
        return self._release(final=False)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end) when the output ends."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.read_offset == len(self.token_ids):
            return ""
        prefix_text = self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self.tokenizer.decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or (full_text.endswith(_INCOMPLETE) and not final):
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        # Keep the window short: drop tokens that no longer affect the next decode.
        if self.prefix_offset > _CONTEXT_TOKENS:
            drop = self.prefix_offset - _CONTEXT_TOKENS
            self.token_ids = self.token_ids[drop:]
            self.prefix_offset -= drop
            self.read_offset -= drop
        return delta


class StopStringMatcher:
    """Finds the earliest stop string in the streamed text; releases only text that cannot be
    the start of one."""

    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self.text = ""
        self.released = 0
        """Characters of `text` already released to the caller."""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add new text. Returns (text to release now, whether a stop string matched).

        On a match, the text up to (not including) the stop string is released and the rest is
        dropped.
        """
        self.text += delta
        if not self.stop:
            return self._release_to(len(self.text)), False
        # Text before `released` was checked and cannot start a match, so search from there.
        matches = [i for i in (self.text.find(s, self.released) for s in self.stop) if i >= 0]
        if matches:
            return self._release_to(min(matches)), True
        return self._release_to(len(self.text) - self._held_suffix()), False

    def flush(self) -> str:
        """The held-back text, when the output ends without a stop string."""
        return self._release_to(len(self.text))

    def _held_suffix(self) -> int:
        """Length of the longest unreleased suffix of `text` that is a proper prefix of a stop."""
        pending = self.text[self.released :]
        for length in range(min(len(pending), max(len(s) for s in self.stop) - 1), 0, -1):
            if any(s.startswith(pending[-length:]) for s in self.stop):
                return length
        return 0

    def _release_to(self, end: int) -> str:
        out = self.text[self.released : end]
        self.released = end
        return out
