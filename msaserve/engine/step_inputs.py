"""Builds the one per-step `AttentionMetadata` (CONTRIBUTING.md §3) and the flat token ids of a step.

Two stages, shared by the plain runner and the ranks of a multi-rank replica: `build_host_step`
writes every integer input of the step into one flat int64 numpy buffer on the host (no torch);
`HostStep.upload` makes it one tensor on the device in one copy (pinned and asynchronous on CUDA)
and cuts the step's tensors out of it as views. A multi-rank replica's driver sends the host step as
is (`parallel/messages.py`); each rank uploads it with the same code as the plain runner.

Buffer layout (`StepLayout`), T new tokens of B sequences, block tables W pages wide:
int64 words `[0, T)` input ids, `[T, 2T)` positions, `[2T, 3T)` slots, `[3T, 3T + B)` logits rows,
then (from an even word, so 16-byte aligned) int32 words: block tables [B, W], seq_lens [B],
cu_seqlens_q [B + 1].
"""

from dataclasses import dataclass

import numpy as np
import torch

from msaserve.engine.scheduler import ScheduledBatch
from msaserve.models.metadata import AttentionMetadata


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    """[T] int64: the new tokens of every scheduled sequence, flattened."""
    meta: AttentionMetadata
    sample_rows: list[int]
    """Batch rows that reach their last token this step (they get a token sampled)."""


@dataclass(frozen=True)
class StepLayout:
    """Where each input of a step of `num_tokens` new tokens of `num_seqs` sequences, block tables
    `width` pages wide, lies in the step's flat int64 buffer."""

    num_tokens: int
    num_seqs: int
    width: int

    @property
    def int_start(self) -> int:
        """First int64 word of the int32 part (even: 16-byte aligned)."""
        longs = 3 * self.num_tokens + self.num_seqs
        return longs + (longs & 1)

    @property
    def num_words(self) -> int:
        ints = self.num_seqs * self.width + 2 * self.num_seqs + 1
        return self.int_start + (ints + 1) // 2

    def split(self, flat):
        """The views of `flat` (int64 [num_words], numpy or torch) → (input ids [T], positions [T],
        slots [T], logits rows [B], block tables [B, W] int32, seq_lens [B] int32, cu_seqlens_q
        [B + 1] int32)."""
        t, b, w = self.num_tokens, self.num_seqs, self.width
        ints = flat[self.int_start :].view(np.int32 if isinstance(flat, np.ndarray) else torch.int32)
        return (flat[:t], flat[t : 2 * t], flat[2 * t : 3 * t], flat[3 * t : 3 * t + b],
                ints[: b * w].reshape(b, w), ints[b * w : b * w + b], ints[b * w + b : b * w + 2 * b + 1])


@dataclass
class HostStep:
    """A step's integer inputs on the host, in one flat buffer (layout: `StepLayout`)."""

    buffer: np.ndarray
    """int64 [layout.num_words]."""
    layout: StepLayout
    max_query_len: int
    decode_query_len: int | None
    sample_rows: list[int]
    """Batch rows that reach their last token this step (they get a token sampled)."""

    def upload(self, device: torch.device, record_selections: bool = False
               ) -> tuple[torch.Tensor, AttentionMetadata]:
        """(input ids [T], the step's metadata), on `device` in one copy."""
        ids, positions, slots, logits_rows, tables, seq_lens, cu_seqlens = self.layout.split(
            _to_device(self.buffer, device))
        meta = AttentionMetadata(
            positions=positions, slot_mapping=slots, block_tables=tables, seq_lens=seq_lens,
            cu_seqlens_q=cu_seqlens, max_query_len=self.max_query_len,
            decode_query_len=self.decode_query_len, logits_indices=logits_rows,
            selections=[] if record_selections else None,
        )
        return ids, meta


def build_step_inputs(
    batch: ScheduledBatch, page_size: int, device: torch.device, record_selections: bool = False
) -> StepInputs:
    """Positions, slots, block tables and offsets of `batch`, computed on the host and copied to
    `device` once."""
    host = build_host_step(batch, page_size)
    input_ids, meta = host.upload(device, record_selections)
    return StepInputs(input_ids, meta, host.sample_rows)


class TableMirror:
    """A sequence's block table as a growing int32 array, so a step copies it with numpy instead of
    converting a Python list (8,192 pages at 1M tokens: ~0.2 ms of host time per step, every step).

    It follows one list object: the engine only ever appends to a sequence's block table in place
    (`BlockManager.allocate_for`); every other change assigns a new list (`Sequence.block_table`).
    A new list object, a shorter list or a changed last mirrored page makes it convert again."""

    def __init__(self, table: list[int]) -> None:
        self.source = table
        self.length = len(table)
        self.array = np.empty(max(16, 2 * self.length), dtype=np.int32)
        self.array[: self.length] = table

    def follows(self, table: list[int]) -> bool:
        n = self.length
        return table is self.source and len(table) >= n and (n == 0 or table[n - 1] == self.array[n - 1])

    def view(self) -> np.ndarray:
        """The table now: appended pages copied in, the array grown by doubling."""
        table, n = self.source, self.length
        if len(table) > n:
            if len(table) > len(self.array):
                grown = np.empty(2 * len(table), dtype=np.int32)
                grown[:n] = self.array[:n]
                self.array = grown
            self.array[n : len(table)] = table[n:]
            self.length = len(table)
        return self.array[: self.length]


def table_array(seq) -> np.ndarray:
    """seq.block_table as int32 numpy (a view of the sequence's `TableMirror`: do not keep it)."""
    mirror = seq.table_mirror
    if mirror is None or not mirror.follows(seq.block_table):
        mirror = seq.table_mirror = TableMirror(seq.block_table)
    return mirror.view()


def build_host_step(batch: ScheduledBatch, page_size: int) -> HostStep:
    """The step's inputs written straight into their flat host buffer (numpy only)."""
    lengths = batch.num_new_tokens
    layout = StepLayout(sum(lengths), len(batch), max(len(seq.block_table) for seq in batch.seqs))
    buffer = np.empty(layout.num_words, dtype=np.int64)
    ids, positions, slots, logits_rows, tables, seq_lens, cu_seqlens = layout.split(buffer)
    tables.fill(-1)
    cu_seqlens[0] = 0
    offset = 0
    sample_rows = []
    for row, (seq, num_new) in enumerate(zip(batch.seqs, lengths, strict=True)):
        start, table = seq.num_computed_tokens, seq.block_table
        stop = start + num_new
        if num_new == 1:  # decode: scalars, no temporary arrays
            ids[offset] = seq.token_ids[start]
            positions[offset] = start
            slots[offset] = table[start // page_size] * page_size + start % page_size
        else:
            pos = np.arange(start, stop, dtype=np.int64)
            ids[offset : offset + num_new] = seq.token_ids[start:stop]
            positions[offset : offset + num_new] = pos
            first_page = start // page_size  # only the pages this step writes, not the whole table
            pages = np.asarray(table[first_page : (stop - 1) // page_size + 1], dtype=np.int64)
            pages = pages[pos // page_size - first_page]
            slots[offset : offset + num_new] = pages * page_size + pos % page_size
        offset += num_new
        seq_lens[row] = stop
        cu_seqlens[row + 1] = offset
        logits_rows[row] = offset - 1
        tables[row, : len(table)] = table_array(seq)
        if stop == seq.num_tokens:  # ScheduledBatch.samples: it reaches its last token
            sample_rows.append(row)
    decode = all(n == 1 for n in lengths)
    return HostStep(buffer, layout, max(lengths), 1 if decode else None, sample_rows)


def _to_device(buffer: np.ndarray, device: torch.device) -> torch.Tensor:
    """The host buffer as one tensor on `device`. On CUDA through pinned memory, so the copy is
    asynchronous (ordered before the step's kernels on the stream): a step's seven small copies
    from pageable memory each waited for the device; on the H200 they were a quarter of a decode
    step's host time. A read-only buffer (one a transport handed over without a copy) is copied
    once on the CPU, as torch wants writable memory."""
    if device.type == "cuda":
        pinned = torch.empty(buffer.shape, dtype=torch.int64, pin_memory=True)
        pinned.numpy()[...] = buffer
        return pinned.to(device, non_blocking=True)
    flat = torch.from_numpy(buffer if buffer.flags.writeable else buffer.copy())
    return flat if device.type == "cpu" else flat.to(device)
