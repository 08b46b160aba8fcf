"""The engine's configuration: one checked dataclass (CONTRIBUTING.md §6: pydantic at the edges, here
not). The fields a user sets come from `EngineSettings` (settings.py), defaults included."""

from dataclasses import dataclass, field
from typing import Any

from msaserve.engine.settings import DEFAULT_CPU_KV_CACHE_BYTES, EngineSettings, engine_default
from msaserve.kernels.backends import backend_names as attention_backend_names

KV_CACHE_DTYPES = ("auto", "fp8")
INDEX_CACHE_DTYPES = ("auto", "bf16", "fp8")
DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class EngineConfig:
    """How one replica runs its model. Every field is checked in `__post_init__`."""

    model: str = "tiny"
    """Model spec passed to `msaserve.models.loader.load_model` (a preset name, a checkpoint
    directory, or a GGUF file)."""
    model_overrides: dict[str, Any] = field(default_factory=dict)
    """Config fields passed to the loader (m3-proxy needs num_layers; GGUF takes page_size, top_k)."""
    device: str = "cpu"
    """torch device: "cpu", "cuda", "cuda:1", ..."""
    dtype: str = "float32"
    """Weights and activations: bfloat16, float16 or float32."""
    attention_backend: str = "msa"
    """naive (MSA reference ops), triton (MSA GPU kernels), dense (SDPA baseline), msa (triton on
    CUDA, naive elsewhere)."""
    num_pages: int | None = None
    """KV pages in the pool (one page = P tokens of K, V and index-K in every layer). None: plan
    from free HBM on GPU, or from `cpu_kv_cache_bytes` on CPU."""
    gpu_memory_utilization: float = engine_default("gpu_memory_utilization")
    """Share of the GPU's free memory the engine may use (weights are already loaded)."""
    cpu_kv_cache_bytes: int = DEFAULT_CPU_KV_CACHE_BYTES
    """Bytes of KV pool on CPU when num_pages is None."""
    max_num_seqs: int = engine_default("max_num_seqs")
    """Sequences running at once (decode batch size bound)."""
    max_num_batched_tokens: int = engine_default("max_num_batched_tokens")
    """Token budget of one step: decodes plus prefill chunks (chunked prefill)."""
    max_model_len: int = engine_default("max_model_len")
    """Prompt plus output tokens of one request."""
    max_waiting: int = engine_default("max_waiting")
    """Requests allowed in the waiting queue; beyond it `generate` raises QueueFull."""
    enable_prefix_caching: bool = engine_default("enable_prefix_caching")
    kv_cache_dtype: str = engine_default("kv_cache_dtype")
    """auto (the model dtype) or fp8 (float8_e4m3fn storage for K and V)."""
    index_cache_dtype: str = engine_default("index_cache_dtype")
    """auto (the model dtype), bf16, or fp8 (with per-key scales)."""
    cuda_graphs: bool = engine_default("enable_cuda_graphs")
    """Capture decode steps as CUDA graphs per batch size (GPU only; ignored on CPU)."""
    decode_steps: int = engine_default("decode_steps")
    """Decode steps per scheduling round (1–64). Above 1, a decode-only batch of greedy requests
    has up to this many steps queued on the device at once, each step's tokens fed to the next
    there: scheduling and step inputs are paid once per round, and each step's tokens are handed
    out (streamed) as the device produces them, while it runs the next steps. Tokens are the same;
    a request arriving meanwhile waits for the round to end."""
    sparse_residency_sessions: int = engine_default("sparse_residency_sessions")
    """Long decoding requests moved off the page pool at once, each decoding with its index and a
    working set of its K/V on the device (`engine/kv/resident_lane.py`); 0: off."""
    sparse_residency_min_tokens: int = engine_default("sparse_residency_min_tokens")
    """Context at which a decoding request moves off the pool (while there is room)."""
    sparse_residency_budget: float = engine_default("sparse_residency_budget")
    """Share of a max_model_len request's K/V pages per layer a sparse-resident request keeps on the
    device (at least the write ring and one step's selection)."""
    tensor_parallel_size: int = engine_default("tensor_parallel_size")
    """Ranks attention and the dense MLPs are split over (engine/parallel/, docs/scaling.md)."""
    expert_parallel_size: int = engine_default("expert_parallel_size")
    """Ranks the routed experts are spread over; the replica runs tp × ep ranks."""
    placement_strategy: str = engine_default("placement_strategy")
    """Ray placement strategy of the replica's rank bundles (STRICT_PACK: one node)."""
    collective_timeout_s: float = engine_default("collective_timeout_s")
    """Longest a step or collective of a multi-rank replica waits for a rank before it fails."""
    swap_space_bytes: int = 4 << 30
    """Host memory for pages of preempted sequences; when full, preemption recomputes instead."""
    seed: int = 0
    """Seed of the generators of requests that give no seed."""

    def __post_init__(self) -> None:
        self._check_choice("attention_backend", self.attention_backend, attention_backend_names())
        self._check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        self._check_choice("index_cache_dtype", self.index_cache_dtype, INDEX_CACHE_DTYPES)
        self._check_choice("dtype", self.dtype, DTYPES)
        positive = {
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "max_waiting": self.max_waiting,
            "tensor_parallel_size": self.tensor_parallel_size,
            "expert_parallel_size": self.expert_parallel_size,
        }
        for name, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name}={value!r} is invalid: allowed an integer ≥ 1")
        if not isinstance(self.decode_steps, int) or not 1 <= self.decode_steps <= 64:
            raise ValueError(f"EngineConfig.decode_steps={self.decode_steps!r} is invalid: "
                             "allowed an integer from 1 to 64")
        if not isinstance(self.sparse_residency_sessions, int) or self.sparse_residency_sessions < 0:
            raise ValueError(f"EngineConfig.sparse_residency_sessions={self.sparse_residency_sessions!r} is "
                             "invalid: allowed an integer ≥ 0 (0: off)")
        if self.sparse_residency_sessions and self.world_size > 1:
            raise ValueError(f"EngineConfig.sparse_residency_sessions={self.sparse_residency_sessions} is "
                             f"invalid with {self.world_size} ranks per replica: allowed 0 unless the "
                             "replica has one rank")
        if not isinstance(self.sparse_residency_min_tokens, int) or self.sparse_residency_min_tokens < 1:
            raise ValueError(f"EngineConfig.sparse_residency_min_tokens={self.sparse_residency_min_tokens!r} "
                             "is invalid: allowed an integer ≥ 1")
        if not 0.0 < self.sparse_residency_budget <= 1.0:
            raise ValueError(f"EngineConfig.sparse_residency_budget={self.sparse_residency_budget!r} is "
                             "invalid: allowed greater than 0 and at most 1")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"EngineConfig.num_pages={self.num_pages!r} is invalid: allowed None or ≥ 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"EngineConfig.gpu_memory_utilization={self.gpu_memory_utilization!r} is invalid: "
                "allowed greater than 0 and at most 1"
            )
        for name in ("cpu_kv_cache_bytes", "swap_space_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"EngineConfig.{name}={getattr(self, name)!r} is invalid: allowed ≥ 0")

    @property
    def world_size(self) -> int:
        """Ranks of one replica: tensor_parallel_size × expert_parallel_size."""
        return self.tensor_parallel_size * self.expert_parallel_size

    @classmethod
    def from_settings(
        cls, settings: EngineSettings, *, model: str, device: str, dtype: str, attention_backend: str,
    ) -> "EngineConfig":
        """The engine's config from the user-facing `engine:` settings and the model section."""
        pool_bytes = settings.kv_cache_memory_bytes
        pool = {} if pool_bytes is None else {"cpu_kv_cache_bytes": pool_bytes}
        return cls(
            model=model, device=device, dtype=dtype, attention_backend=attention_backend,
            num_pages=settings.num_pages, gpu_memory_utilization=settings.gpu_memory_utilization,
            max_num_seqs=settings.max_num_seqs, max_num_batched_tokens=settings.max_num_batched_tokens,
            max_model_len=settings.max_model_len, max_waiting=settings.max_waiting,
            enable_prefix_caching=settings.enable_prefix_caching, kv_cache_dtype=settings.kv_cache_dtype,
            index_cache_dtype=settings.index_cache_dtype, cuda_graphs=settings.enable_cuda_graphs,
            decode_steps=settings.decode_steps,
            sparse_residency_sessions=settings.sparse_residency_sessions,
            sparse_residency_min_tokens=settings.sparse_residency_min_tokens,
            sparse_residency_budget=settings.sparse_residency_budget,
            tensor_parallel_size=settings.tensor_parallel_size,
            expert_parallel_size=settings.expert_parallel_size,
            placement_strategy=settings.placement_strategy,
            collective_timeout_s=settings.collective_timeout_s, **pool,
        )

    @staticmethod
    def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
        if value not in allowed:
            raise ValueError(f"EngineConfig.{name}={value!r} is invalid: allowed {', '.join(allowed)}")
