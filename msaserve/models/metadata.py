"""The per-step attention inputs: built once per step by the runner, read by every layer."""

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Everything a layer needs to write this step's K/V/index-K and attend (CONTRIBUTING.md §3).

    The step's new tokens of all sequences are flattened into one axis of length T.
    """

    positions: torch.Tensor
    """[T] int64: position of each new token in its sequence."""
    slot_mapping: torch.Tensor
    """[T] int64: physical slot (page * P + offset) where each new token's K, V and index-K go."""
    block_tables: torch.Tensor
    """[B, max_pages] int32: logical page → physical page; -1 = not resident."""
    seq_lens: torch.Tensor
    """[B] int32: tokens of each sequence after this step (cached + new)."""
    cu_seqlens_q: torch.Tensor
    """[B + 1] int32: offsets of each sequence's new tokens in the flat axis."""
    max_query_len: int
    """Longest run of new tokens of one sequence in this step."""
    decode_query_len: int | None = None
    """Q when every sequence has exactly Q (1–16) new tokens: layers use the decode ops."""
    logits_indices: torch.Tensor | None = None
    """[B] int64: flat index of the token whose logits each sequence needs (usually its last)."""
    kv_slot_mapping: torch.Tensor | None = None
    """[T] int64: where each new token's K and V go when they live in another pool than its
    index-K (sparse residency, `engine/kv/residency.py`: every index page resident, a small
    working set of K/V pages); None: `slot_mapping` for all three. Layers that attend densely (no
    index branch) always write their K/V at `slot_mapping`: they read every page."""
    selections: list[torch.Tensor] | None = None
    """If a list, each MSA layer appends its block selection [T, Hkv, K] int32 (for the KV cache
    service's lazy page fetch and for tests); None skips recording."""

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.decode_query_len is not None
