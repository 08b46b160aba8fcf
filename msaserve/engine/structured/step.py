"""The engine's side of constrained decoding: matchers per sequence, one batch bitmask per step.

`GrammarRuntime.begin(seqs)` starts filling the bitmask of every constrained sequence in the batch
on a worker thread (llguidance releases the GIL), so it overlaps the model's forward pass;
`mask(...)` waits for it and keeps the rows that sample this step; `advance` feeds each sampled
token to its sequence's matcher.
"""

import logging
from concurrent.futures import Future

import torch

from msaserve.engine.sampler import GrammarMask
from msaserve.engine.sequence import Sequence
from msaserve.engine.structured.bitmask import BatchMasker
from msaserve.engine.structured.grammars import GrammarCompiler, llg_tokenizer
from msaserve.engine.types import GrammarSpec

logger = logging.getLogger(__name__)


class GrammarRuntime:
    def __init__(self, tokenizer: object, vocab_size: int, eos_token_ids: set[int]) -> None:
        self.compiler = GrammarCompiler(llg_tokenizer(tokenizer, vocab_size, eos_token_ids))
        self.masker = BatchMasker(vocab_size)

    def check(self, spec: GrammarSpec) -> None:
        """Raise InvalidParameter (naming the construct) if `spec` does not compile."""
        self.compiler.matcher(spec)

    def start(self, seq: Sequence, spec: GrammarSpec) -> None:
        seq.matcher = self.compiler.matcher(spec)

    def begin(self, seqs: list[Sequence]) -> "tuple[list[int], Future[torch.Tensor]] | None":
        """Start the bitmask of the batch's constrained rows: (their batch rows, the pending mask)."""
        rows = [row for row, seq in enumerate(seqs) if seq.matcher is not None]
        if not rows:
            return None
        return rows, self.masker.fill_async([seqs[row].matcher for row in rows])

    @staticmethod
    def mask(pending: "tuple[list[int], Future[torch.Tensor]] | None", sample_rows: list[int]
             ) -> GrammarMask | None:
        """The mask in sampler rows (row i of the logits is batch row sample_rows[i])."""
        if pending is None:
            return None
        rows, future = pending
        bitmask = future.result()
        position = {row: i for i, row in enumerate(rows)}
        keep = [(i, position[row]) for i, row in enumerate(sample_rows) if row in position]
        if not keep:
            return None
        return GrammarMask(bitmask[[k for _, k in keep]], [i for i, _ in keep])

    @staticmethod
    def advance(seq: Sequence, token: int) -> None:
        if seq.matcher is None:
            return
        if not seq.matcher.consume_token(token):
            logger.warning("[%s] grammar refused sampled token %d: %s", seq.request_id, token,
                           seq.matcher.get_error())
