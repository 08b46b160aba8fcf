"""What the driver sends the ranks each step: one `StepMessage` read by every rank (the step's one
broadcast; no per-layer round trips): inline in each rank's call when small, else put in Ray's
object store once (`group.py`).

The message is the step's `HostStep` as the driver built it (`engine/step_inputs.py`: every integer
input in one flat int64 buffer, numpy only, no torch on the driver) plus what the rank does with
it. A rank uploads it with the plain runner's own code (`HostStep.upload`: one pinned, asynchronous
copy to its device). It pickles (Ray's transport) as the buffer's raw bytes and a few ints; the rank
reads the bytes in place (no copy before the pinned one).
"""

from dataclasses import dataclass

import numpy as np

from msaserve.engine.step_inputs import HostStep, StepLayout


@dataclass
class StepMessage:
    step: HostStep
    decode_steps: int = 1
    """Above 1: a greedy decode round of that many steps on the ranks (tokens come back)."""
    greedy: bool = False
    """Rank 0 returns the argmax token of each sampled row (list[int]) instead of its logits."""

    def __reduce__(self) -> tuple:
        """Pickled as the buffer's raw bytes and plain ints, rebuilt by one call; the sampled rows
        travel only when some row does not sample (a prefill chunk), as None otherwise (every
        decode step)."""
        step, layout = self.step, self.step.layout
        rows = None if len(step.sample_rows) == layout.num_seqs else step.sample_rows
        return _from_wire, (step.buffer.tobytes(), layout.num_tokens, layout.num_seqs, layout.width,
                            step.max_query_len, step.decode_query_len, rows, self.decode_steps, self.greedy)

    @property
    def nbytes(self) -> int:
        return self.step.buffer.nbytes


def _from_wire(data: bytes, num_tokens: int, num_seqs: int, width: int, max_query_len: int,
               decode_query_len: int | None, rows: list[int] | None, decode_steps: int, greedy: bool
               ) -> StepMessage:
    # Read-only over the pickle's bytes: the upload copies it (into pinned memory on CUDA).
    buffer = np.frombuffer(data, dtype=np.int64)
    rows = list(range(num_seqs)) if rows is None else rows
    step = HostStep(buffer, StepLayout(num_tokens, num_seqs, width), max_query_len, decode_query_len, rows)
    return StepMessage(step, decode_steps, greedy)
