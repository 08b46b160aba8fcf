"""The engine's configuration: one checked dataclass (STYLE §6: pydantic at the edges, here not)."""

from dataclasses import dataclass, field
from typing import Any

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
    gpu_memory_utilization: float = 0.9
    """Share of the GPU's free memory the engine may use (weights are already loaded)."""
    cpu_kv_cache_bytes: int = 1 << 30
    """Bytes of KV pool on CPU when num_pages is None."""
    max_num_seqs: int = 32
    """Sequences running at once (decode batch size bound)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step: decodes plus prefill chunks (chunked prefill)."""
    max_model_len: int = 8192
    """Prompt plus output tokens of one request."""
    max_waiting: int = 256
    """Requests allowed in the waiting queue; beyond it `generate` raises QueueFull."""
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    """auto (the model dtype) or fp8 (float8_e4m3fn storage for K and V)."""
    index_cache_dtype: str = "auto"
    """auto (the model dtype), bf16, or fp8 (with per-key scales)."""
    cuda_graphs: bool = True
    """Capture decode steps as CUDA graphs per batch size (GPU only; ignored on CPU)."""
    decode_steps: int = 1
    """Decode steps per scheduling round (1–64). Above 1, a decode-only batch of greedy requests
    runs up to this many steps back to back on the device, each step's tokens fed to the next
    there, with one host synchronisation per round: the host's per-step work (scheduling, step
    inputs, outputs) is paid once per round. Tokens are the same; they stream in bursts, and a
    request arriving meanwhile waits for the round to end."""
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
        }
        for name, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name}={value!r} is invalid: allowed an integer ≥ 1")
        if not isinstance(self.decode_steps, int) or not 1 <= self.decode_steps <= 64:
            raise ValueError(f"EngineConfig.decode_steps={self.decode_steps!r} is invalid: "
                             "allowed an integer from 1 to 64")
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

    @staticmethod
    def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
        if value not in allowed:
            raise ValueError(f"EngineConfig.{name}={value!r} is invalid: allowed {', '.join(allowed)}")
