"""What the driver sends the ranks each step: one `StepMessage` read by every rank (the step's one
broadcast; no per-layer round trips): inline in each rank's call when small, else put in Ray's
object store once (`group.py`).

Fixed layout: the step's integer tensors travel as two flat numpy buffers (int64: token ids,
positions, slots, logits rows; int32: block tables, sequence lengths, offsets) plus their sizes,
so a rank makes two pinned, asynchronous copies to its device (as the plain runner's
`build_step_inputs` does) instead of one pageable, synchronous copy per tensor. It pickles (Ray's
transport) as the two buffers' raw bytes and plain fields: on the dev CPU ~7 µs there and back,
against ~40 µs for numpy arrays and ~400 µs for the torch tensors the message held before.
"""

from dataclasses import dataclass

import numpy as np
import torch

from msaserve.engine.step_inputs import StepInputs
from msaserve.models.metadata import AttentionMetadata


@dataclass
class StepMessage:
    longs: np.ndarray
    """int64 [3·T + B]: input ids [T], positions [T], slots [T], logits rows [B]."""
    ints: np.ndarray
    """int32: block tables [B, max_pages] flattened, seq_lens [B], cu_seqlens_q [B + 1]."""
    num_tokens: int
    num_seqs: int
    max_query_len: int
    decode_query_len: int | None
    sample_rows: list[int]
    """Batch rows that get a token this step (their logits, or their greedy token, come back)."""
    decode_steps: int = 1
    """Above 1: a greedy decode round of that many steps on the ranks (tokens come back)."""
    greedy: bool = False
    """Rank 0 returns the argmax token of each sampled row (list[int]) instead of its logits."""

    def __getstate__(self) -> tuple:
        """Pickled as raw bytes and plain fields: a third of the numpy arrays' pickling cost."""
        return (self.longs.tobytes(), self.ints.tobytes(), self.num_tokens, self.num_seqs, self.max_query_len,
                self.decode_query_len, self.sample_rows, self.decode_steps, self.greedy)

    def __setstate__(self, state: tuple) -> None:
        longs, ints, *rest = state
        self.longs = np.frombuffer(bytearray(longs), dtype=np.int64)
        self.ints = np.frombuffer(bytearray(ints), dtype=np.int32)
        (self.num_tokens, self.num_seqs, self.max_query_len, self.decode_query_len, self.sample_rows,
         self.decode_steps, self.greedy) = rest

    @property
    def nbytes(self) -> int:
        return self.longs.nbytes + self.ints.nbytes

    @classmethod
    def pack(cls, inputs: StepInputs, decode_steps: int = 1, greedy: bool = False) -> "StepMessage":
        """The message of host-built step inputs (`build_step_inputs` on the CPU)."""
        meta = inputs.meta
        if meta.selections is not None or meta.kv_slot_mapping is not None:
            raise ValueError("StepMessage.pack: meta.selections and meta.kv_slot_mapping must be None "
                             "(a multi-rank step neither records selections nor splits K/V pools)")
        longs = torch.cat([inputs.input_ids, meta.positions, meta.slot_mapping, meta.logits_indices])
        ints = torch.cat([meta.block_tables.reshape(-1), meta.seq_lens, meta.cu_seqlens_q])
        longs, ints = longs.numpy(), ints.numpy()
        return cls(longs, ints, int(inputs.input_ids.shape[0]), meta.num_seqs, meta.max_query_len,
                   meta.decode_query_len, list(inputs.sample_rows), decode_steps, greedy)

    def unpack(self, device: torch.device) -> tuple[torch.Tensor, AttentionMetadata]:
        """(input ids [T], the step's metadata), on `device` in two copies."""
        longs, ints = _to_device(self.longs, device), _to_device(self.ints, device)
        t, b = self.num_tokens, self.num_seqs
        max_pages = (self.ints.size - 2 * b - 1) // b
        meta = AttentionMetadata(
            positions=longs[t : 2 * t], slot_mapping=longs[2 * t : 3 * t],
            block_tables=ints[: b * max_pages].view(b, max_pages),
            seq_lens=ints[b * max_pages : b * max_pages + b], cu_seqlens_q=ints[b * max_pages + b :],
            max_query_len=self.max_query_len, decode_query_len=self.decode_query_len,
            logits_indices=longs[3 * t :],
        )
        return longs[:t], meta


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    # Ray hands large arrays over read-only (zero copy); torch wants writable memory.
    flat = torch.from_numpy(array if array.flags.writeable else array.copy())
    if device.type == "cuda":  # pinned: the copy is asynchronous, ordered before the step's kernels
        return flat.pin_memory().to(device, non_blocking=True)
    return flat if device.type == "cpu" else flat.to(device)
