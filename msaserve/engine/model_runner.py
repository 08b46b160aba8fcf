"""Runs the model on a scheduled batch: owns the page pool, builds the step inputs, replays CUDA
graphs for decode, and returns the logits of the sequences that sample."""

import dataclasses
import logging
from collections.abc import Callable

import torch

from msaserve.engine.config import EngineConfig
from msaserve.engine.cuda_graphs import DecodeGraphs
from msaserve.engine.decode_round import RoundTokens
from msaserve.engine.kv.resident_lane import lane_budget_pages, resident_session_bytes
from msaserve.engine.media import release_finished_media, step_input_embeds
from msaserve.engine.memory import cache_dtypes, plan_num_pages
from msaserve.engine.scheduler import ScheduledBatch
from msaserve.engine.step_inputs import StepInputs, build_step_inputs
from msaserve.kernels import AttentionOps, get_ops
from msaserve.models.cache import LayerKVCache, allocate_caches
from msaserve.models.metadata import AttentionMetadata
from msaserve.models.transformer import MSATransformer

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: MSATransformer, config: EngineConfig) -> None:
        self.model = model.eval()
        model.fuse_projections()  # one GEMM for q/k/v/index and one for gate/up, every step
        self.config = config
        self.device = next(model.parameters()).device
        self.ops: AttentionOps = get_ops(model.attention_backend, self.device)
        """The model's attention ops, resolved once; every forward gets them (or a wrapper of them)."""
        self.page_size = model.config.page_size
        self.max_pages = -(-config.max_model_len // self.page_size)
        kv_dtype, index_dtype = cache_dtypes(config)
        activation = 0
        if self.device.type == "cuda" and config.num_pages is None:
            activation = self.profile_activation_bytes(kv_dtype, index_dtype)
            # the sparse-resident lane's sessions (index caches and K/V working sets) come out of
            # the same HBM share, allocated as requests move there
            activation += self.resident_lane_bytes(kv_dtype, index_dtype)
        self.num_pages = plan_num_pages(model.config, config, self.device, activation)
        # One extra physical page is scratch for the padding rows of CUDA graphs; the block
        # manager never hands it out.
        self.scratch_page = self.num_pages
        self.caches: list[LayerKVCache] = allocate_caches(
            model.config, self.num_pages + 1, self.device, kv_dtype, index_dtype
        )
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and config.cuda_graphs and self.ops.graph_capturable:
            graphs = DecodeGraphs(model, self.ops, self.caches, config.max_num_seqs, self.max_pages,
                                  self.scratch_page)
            self.graphs = graphs if graphs.capture() else None
        self.last_selections: list[torch.Tensor] | None = None

    @torch.inference_mode()
    def execute(
        self, batch: ScheduledBatch, record_selections: bool = False,
        ops_wrapper: Callable[[AttentionOps], AttentionOps] | None = None,
    ) -> tuple[StepInputs, torch.Tensor]:
        """Run one step → (its inputs, logits [num sampled rows, vocab] fp32).

        ops_wrapper: this step runs `ops_wrapper(self.ops)` instead of the ops (the KV cache
        service's adoption fetches the pages each layer selects); such a step records its
        selections, so it never replays a CUDA graph."""
        record_selections = record_selections or ops_wrapper is not None
        inputs = build_step_inputs(batch, self.page_size, self.device, record_selections)
        embeds = step_input_embeds(self.model, batch.seqs, batch.num_new_tokens, inputs.input_ids)
        ops = self.ops if ops_wrapper is None else ops_wrapper(self.ops)
        hidden = self.forward(inputs.input_ids, inputs.meta, embeds, ops)
        release_finished_media(batch.seqs, batch.num_new_tokens)
        self.last_selections = inputs.meta.selections
        last_token = inputs.meta.logits_indices  # [B]
        if len(inputs.sample_rows) < len(batch):  # some rows are mid-prefill: no token yet
            rows = torch.tensor(inputs.sample_rows, dtype=torch.long, device=self.device)
            last_token = last_token[rows]  # [N]
        if inputs.meta.is_decode and len(inputs.sample_rows) == hidden.shape[0]:
            return inputs, self.model.compute_logits(hidden)  # one row per sequence, all sample
        return inputs, self.model.compute_logits(hidden[last_token])

    @torch.inference_mode()
    def execute_decode_round(self, batch: ScheduledBatch, steps: int) -> RoundTokens:
        """Queue `steps` greedy decode steps of a decode-only batch → their tokens [steps][B] as the
        device produces them (`RoundTokens.step(i)` waits for step i only). Each step's argmax is
        the next step's input on the device, and positions, slots and lengths advance there. The
        block tables must already hold the pages of all `steps` tokens (`LLMEngine` allocates
        them)."""
        inputs = build_step_inputs(batch, self.page_size, self.device)
        if not inputs.meta.is_decode or len(inputs.sample_rows) != len(batch):
            raise ValueError("execute_decode_round needs a batch of one new token per sequence")
        return self.queue_decode_round(inputs.input_ids, inputs.meta, steps)

    def decode_round(self, ids: torch.Tensor, meta: AttentionMetadata, steps: int) -> list[list[int]]:
        """The round from a decode step's inputs → tokens [steps][B], once all are done: the ranks
        of a multi-rank replica run it from the driver's step message."""
        return self.queue_decode_round(ids, meta, steps).all()

    @torch.inference_mode()
    def queue_decode_round(self, ids: torch.Tensor, meta: AttentionMetadata, steps: int) -> RoundTokens:
        """The round's loop from a decode step's inputs (ids [B], meta on the device)."""
        page_size = self.page_size
        sampled = []
        for step in range(steps):
            if step:
                positions = meta.positions + 1
                pages = meta.block_tables.gather(1, (positions // page_size)[:, None])[:, 0].long()
                meta = dataclasses.replace(meta, positions=positions, seq_lens=meta.seq_lens + 1,
                                           slot_mapping=pages * page_size + positions % page_size)
            hidden = self.forward(ids, meta)
            ids = torch.argmax(self.model.compute_logits(hidden), dim=-1)
            sampled.append(ids)
        self.last_selections = None
        return RoundTokens.record(sampled)

    def forward(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, input_embeds: torch.Tensor | None = None,
        ops: AttentionOps | None = None,
    ) -> torch.Tensor:
        """input_embeds [T, H]: token embeddings with media rows merged (prefill steps with media);
        ops: this step's attention ops (default: the resolved `self.ops`)."""
        ops = self.ops if ops is None else ops
        if input_embeds is not None:
            return self.model(input_ids, meta, self.caches, input_embeds=input_embeds, ops=ops)
        if (self.graphs is not None and ops is self.ops and meta.selections is None
                and self.graphs.can_run(meta)):
            return self.graphs.run(input_ids, meta)
        return self.model(input_ids, meta, self.caches, ops=ops)

    @torch.inference_mode()
    def profile_activation_bytes(self, kv_dtype: torch.dtype, index_dtype: torch.dtype) -> int:
        """Peak memory of a forward pass of one full step budget, as one prefill chunk, measured
        on a throwaway pool just large enough for it."""
        num_tokens = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        num_pages = -(-num_tokens // self.page_size)
        caches = allocate_caches(self.model.config, num_pages, self.device, kv_dtype, index_dtype)
        positions = torch.arange(num_tokens, device=self.device)
        meta = AttentionMetadata(
            positions=positions, slot_mapping=positions.clone(),
            block_tables=torch.arange(num_pages, device=self.device, dtype=torch.int32)[None],
            seq_lens=torch.tensor([num_tokens], device=self.device, dtype=torch.int32),
            cu_seqlens_q=torch.tensor([0, num_tokens], device=self.device, dtype=torch.int32),
            max_query_len=num_tokens,
        )
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        hidden = self.model(torch.zeros(num_tokens, dtype=torch.long, device=self.device), meta, caches,
                            ops=self.ops)
        self.model.compute_logits(hidden[-1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del caches, hidden
        torch.cuda.empty_cache()
        logger.info("activation peak of a %d-token step: %.2f GiB", num_tokens, peak / 2**30)
        return int(peak)

    def resident_lane_bytes(self, kv_dtype: torch.dtype, index_dtype: torch.dtype) -> int:
        """Device bytes of `sparse_residency_sessions` sparse-resident sessions of max_model_len."""
        config = self.config
        if not config.sparse_residency_sessions:
            return 0
        budget = lane_budget_pages(self.model.config, self.max_pages, config.sparse_residency_budget)
        each = resident_session_bytes(self.model.config, self.max_pages, budget, kv_dtype, index_dtype)
        logger.info("sparse-resident lane: %d sessions of %.2f GiB reserved",
                    config.sparse_residency_sessions, each / 2**30)
        return config.sparse_residency_sessions * each

    @property
    def kv_cache_bytes(self) -> int:
        return sum(cache.page_bytes for cache in self.caches) * (self.num_pages + 1)
