"""Grammar-constrained decoding (llguidance): grammars compiled once per hash, one token bitmask for
the whole batch per step, applied to the logits before sampling (docs/api.md, structured outputs)."""
