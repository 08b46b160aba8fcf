"""CUDA graphs for decode steps: one graph per padded batch size, replayed with fresh inputs.

A decode step of B sequences runs the graph captured for the smallest size ≥ B. The padding
rows are dummy one-token sequences whose single page is the runner's scratch page (never given to
a sequence), so they write and read only that page. Block tables are padded to the width that
`max_model_len` needs, so one graph serves every context length.
"""

import logging

import torch

from msaserve.kernels import AttentionOps
from msaserve.models.cache import LayerKVCache
from msaserve.models.metadata import AttentionMetadata
from msaserve.models.transformer import MSATransformer

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sorted({*sizes, max_num_seqs})


class DecodeGraphs:
    def __init__(self, model: MSATransformer, ops: AttentionOps, caches: list[LayerKVCache],
                 max_num_seqs: int, max_pages: int, scratch_page: int) -> None:
        self.model = model
        self.ops = ops
        self.caches = caches
        self.max_pages = max_pages
        self.scratch_page = scratch_page
        self.page_size = model.config.page_size
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        device = next(model.parameters()).device
        n = self.batch_sizes[-1]
        # Static input buffers; each graph reads views of their first rows.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=device)
        self.block_tables = torch.full((n, max_pages), -1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.cu_seqlens = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            positions=self.positions[:size], slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size], seq_lens=self.seq_lens[:size],
            cu_seqlens_q=self.cu_seqlens[: size + 1], max_query_len=1, decode_query_len=1,
            logits_indices=self.cu_seqlens[1 : size + 1].long() - 1,
        )

    def _reset_padding(self, start: int, stop: int | None = None) -> None:
        """Rows [start, stop) become padding rows (stop None: to the end)."""
        rows = slice(start, stop)
        self.input_ids[rows] = 0
        self.positions[rows] = 0
        self.slot_mapping[rows] = self.scratch_page * self.page_size
        self.block_tables[rows] = -1
        self.block_tables[rows, 0] = self.scratch_page
        self.seq_lens[rows] = 1

    @torch.inference_mode()
    def capture(self) -> bool:
        """Capture every batch size, largest first so the smaller ones share its memory pool.
        Returns False (and keeps eager decode) if the attention ops cannot be captured."""
        self._reset_padding(0)
        pool = None
        try:
            for size in reversed(self.batch_sizes):
                meta = self._meta(size)
                for _ in range(2):  # warm up outside the graph (lazy init, autotuning)
                    self.model(self.input_ids[:size], meta, self.caches, ops=self.ops)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self.model(self.input_ids[:size], meta, self.caches, ops=self.ops)
                pool = graph.pool()
                self.graphs[size] = graph
        except Exception as error:  # e.g. an op that synchronises with the host
            logger.warning("CUDA graph capture failed (%s); decoding without graphs", error)
            self.graphs.clear()
            self.outputs.clear()
            return False
        return True

    def can_run(self, meta: AttentionMetadata) -> bool:
        return (
            bool(self.graphs) and meta.decode_query_len == 1
            and meta.num_seqs <= self.batch_sizes[-1] and meta.block_tables.shape[1] <= self.max_pages
        )

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the graph for this decode step → hidden [B, H]."""
        batch = meta.num_seqs
        size = next(s for s in self.batch_sizes if s >= batch)
        if batch < size:  # the graph reads rows [0, size): only those past the batch are padding
            self._reset_padding(batch, size)  # (six ops of host time a step, skipped when full)
        self.input_ids[:batch] = input_ids
        self.positions[:batch] = meta.positions
        self.slot_mapping[:batch] = meta.slot_mapping
        width = meta.block_tables.shape[1]
        self.block_tables[:batch, :width] = meta.block_tables
        self.block_tables[:batch, width:] = -1
        self.seq_lens[:batch] = meta.seq_lens
        self.graphs[size].replay()
        return self.outputs[size][:batch]
