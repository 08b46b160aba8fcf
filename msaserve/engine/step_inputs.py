"""Builds the one per-step `AttentionMetadata` (STYLE §3) and the flat token ids of a step."""

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
        table = np.asarray(seq.block_table, dtype=np.int64)
        pos = np.arange(start, start + num_new, dtype=np.int64)
        ids.append(np.asarray(seq.token_ids[start : start + num_new], dtype=np.int64))
        positions.append(pos)
        slots.append(table[pos // page_size] * page_size + pos % page_size)
        seq_lens[row] = start + num_new
        cu_seqlens[row + 1] = cu_seqlens[row] + num_new
        block_tables[row, : len(table)] = table
    lengths = batch.num_new_tokens
    decode = all(n == 1 for n in lengths)

    def to_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device, non_blocking=True)

    meta = AttentionMetadata(
        positions=to_device(np.concatenate(positions)),
        slot_mapping=to_device(np.concatenate(slots)),
        block_tables=to_device(block_tables),
        seq_lens=to_device(seq_lens),
        cu_seqlens_q=to_device(cu_seqlens),
        max_query_len=max(lengths),
        decode_query_len=1 if decode else None,
        logits_indices=to_device(cu_seqlens[1:].astype(np.int64) - 1),
        selections=[] if record_selections else None,
    )
    sample_rows = [row for row in range(len(batch)) if batch.samples(row)]
    return StepInputs(to_device(np.concatenate(ids)), meta, sample_rows)
