"""Builds the one per-step `AttentionMetadata` (CONTRIBUTING.md §3) and the flat token ids of a step."""

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


def build_step_inputs(
    batch: ScheduledBatch, page_size: int, device: torch.device, record_selections: bool = False
) -> StepInputs:
    """Positions, slots, block tables and offsets of `batch`, computed on the host in numpy and
    copied to `device` once."""
    ids, positions, slots = [], [], []
    seq_lens = np.empty(len(batch), dtype=np.int32)
    cu_seqlens = np.zeros(len(batch) + 1, dtype=np.int32)
    max_pages = max(len(seq.block_table) for seq in batch.seqs)
    block_tables = np.full((len(batch), max_pages), -1, dtype=np.int32)
    for row, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
        start = seq.num_computed_tokens
        table = seq.block_table
        pos = np.arange(start, start + num_new, dtype=np.int64)
        ids.append(np.asarray(seq.token_ids[start : start + num_new], dtype=np.int64))
        positions.append(pos)
        first_page = start // page_size  # only the pages this step writes, not the whole table
        pages = np.asarray(table[first_page : (start + num_new - 1) // page_size + 1], dtype=np.int64)
        slots.append(pages[pos // page_size - first_page] * page_size + pos % page_size)
        seq_lens[row] = start + num_new
        cu_seqlens[row + 1] = cu_seqlens[row] + num_new
        block_tables[row, : len(table)] = table
    lengths = batch.num_new_tokens
    decode = all(n == 1 for n in lengths)
    long_parts = _upload([np.concatenate(ids), np.concatenate(positions), np.concatenate(slots),
                          cu_seqlens[1:].astype(np.int64) - 1], device)
    int_parts = _upload([block_tables.ravel(), seq_lens, cu_seqlens], device)
    input_ids, positions_d, slots_d, logits_indices = long_parts
    meta = AttentionMetadata(
        positions=positions_d,
        slot_mapping=slots_d,
        block_tables=int_parts[0].view(block_tables.shape),
        seq_lens=int_parts[1],
        cu_seqlens_q=int_parts[2],
        max_query_len=max(lengths),
        decode_query_len=1 if decode else None,
        logits_indices=logits_indices,
        selections=[] if record_selections else None,
    )
    sample_rows = [row for row in range(len(batch)) if batch.samples(row)]
    return StepInputs(input_ids, meta, sample_rows)


def _upload(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """1-D host arrays of one dtype → tensors on `device`, in one copy (pinned, asynchronous on
    CUDA). A step's seven small copies from pageable memory each waited for the device; on the
    H200 they were a quarter of a decode step's host time."""
    flat = torch.from_numpy(np.concatenate(arrays))
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    elif device.type != "cpu":
        flat = flat.to(device)
    out, start = [], 0
    for array in arrays:
        out.append(flat[start : start + array.size])
        start += array.size
    return out
