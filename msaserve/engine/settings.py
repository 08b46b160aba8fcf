"""The engine's user-facing settings: the `engine:` section of `ServeConfig` (pydantic at the edge,
CONTRIBUTING.md §6). The engine's own `EngineConfig` dataclass takes every default it shares with
these from here."""

from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

MiB = 1 << 20
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
"""KV pool bytes on CPU when neither num_pages nor kv_cache_memory_bytes is set."""


class EngineSettings(BaseModel):
    """The `engine:` section of `ServeConfig`: per-replica limits a user sets. `EngineConfig`
    takes its defaults from here, so each default has one value in one place."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    num_pages: int | None = Field(
        None,
        ge=4,
        le=16_777_216,
        description="KV pages per replica; leave unset to size the pool from kv_cache_memory_bytes.",
    )
    max_model_len: int = Field(
        8192, ge=16, le=4_194_304, description="Longest prompt + output of one request, in tokens."
    )
    kv_cache_memory_bytes: int | None = Field(
        None,
        ge=MiB,
        le=1 << 44,
        description="CPU only: bytes per replica for KV + index pages when num_pages is unset; unset: "
        f"{DEFAULT_CPU_KV_CACHE_BYTES >> 30} GiB.",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="CUDA only: share of free GPU memory the KV pool may use."
    )
    max_num_seqs: int = Field(32, ge=1, le=4096, description="Sequences decoded together per step.")
    max_num_batched_tokens: int = Field(
        2048, ge=16, le=1_048_576, description="Token budget of one step (chunked prefill + decode)."
    )
    max_waiting: int = Field(
        256,
        ge=1,
        le=1_000_000,
        description="Requests allowed to wait for a slot; beyond it the API answers 429 with Retry-After.",
    )
    enable_prefix_caching: bool = Field(True, description="Reuse pages of identical prompt prefixes.")
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        "auto", description="dtype of the K/V pages: 'auto' follows model.dtype, 'fp8' stores float8_e4m3."
    )
    index_cache_dtype: Literal["auto", "bf16", "fp8"] = Field(
        "auto", description="dtype of the MSA index-K pages: 'auto' (model.dtype), 'bf16' or 'fp8' (scaled)."
    )
    enable_cuda_graphs: bool = Field(True, description="Capture decode steps as CUDA graphs (CUDA only).")
    decode_steps: int = Field(
        1, ge=1, le=64,
        description="Decode steps per scheduling round: above 1, a decode-only batch of greedy requests has "
        "that many steps queued on the device at once, each token streamed as its step ends (a request "
        "arriving meanwhile waits for the round's end).",
    )
    sparse_residency_sessions: int = Field(
        0, ge=0, le=1024,
        description="Long decoding requests a replica may move off its KV pool at once: each then decodes "
        "with its whole MSA index and only sparse_residency_budget of its K/V on the device, every page's "
        "K/V in host memory (pinned on CUDA), fetched as the indexer selects it (layers that attend densely "
        "keep their whole K/V on the device). A decoding request the pool would preempt moves there too. "
        "They decode beside the pool's batch, not counted in max_num_seqs. 0: off. Needs an MSA backend "
        "and a single-rank replica.",
    )
    sparse_residency_min_tokens: int = Field(
        32768, ge=16, le=4_194_304,
        description="Context (tokens) at which a decoding request moves off the KV pool, when "
        "sparse_residency_sessions has room.",
    )
    sparse_residency_budget: float = Field(
        0.1, gt=0.0, le=1.0,
        description="Share of a max_model_len request's K/V pages per layer kept on the device by a "
        "sparse-resident request (at least the write ring and one step's selection).",
    )

    tensor_parallel_size: int = Field(
        1, ge=1, le=64,
        description="Ranks (GPUs) one replica's attention and dense MLPs are split over; with "
        "expert_parallel_size, the replica reserves tensor_parallel_size × expert_parallel_size GPUs in one "
        "Ray placement group and runs a worker per GPU (MiniMax-M3 only above 1).",
    )
    expert_parallel_size: int = Field(
        1, ge=1, le=64,
        description="Ranks the MoE's routed experts are spread over (tokens sent to them by all-to-all); "
        "must divide the expert count.",
    )
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK",
        description="Ray placement strategy of a multi-rank replica's bundles (one per GPU): STRICT_PACK "
        "keeps them on one node (NVLink).",
    )
    collective_timeout_s: float = Field(
        120.0, gt=0.0, le=3600.0,
        description="Multi-rank replicas: longest a step or collective may wait for a rank; past it the "
        "replica fails (a dead worker never hangs it) and its sessions resume elsewhere.",
    )

    @model_validator(mode="after")
    def _one_pool_size(self) -> Self:
        if self.num_pages is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("engine: set num_pages or kv_cache_memory_bytes, not both")
        ranks = self.tensor_parallel_size * self.expert_parallel_size
        if self.sparse_residency_sessions and ranks > 1:
            raise ValueError(f"engine: sparse_residency_sessions={self.sparse_residency_sessions} is invalid "
                             f"with {ranks} ranks per replica (tensor_parallel_size × expert_parallel_size): "
                             "allowed 0 unless the replica has one rank")
        return self


def engine_default(name: str):
    """The default of an `EngineSettings` field (for `EngineConfig`, so the two never disagree)."""
    return EngineSettings.model_fields[name].default
