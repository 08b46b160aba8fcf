"""`ServeConfig`: the one user-facing description of a deployment (DESIGN §4, platform).

Loaded from YAML (`msaserve serve --config FILE`), passed as `args` to the Serve application
builder (`msaserve.platform.app:app_builder`), and rendered into the Helm chart's serveConfigV2.
Every field carries a description and bounds; a bad value fails with the field's dotted path, the
value and the allowed range (`ServeConfig.from_yaml` formats pydantic's errors that way).
"""

from pathlib import Path
from typing import Any, Literal, Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from msaserve.engine.config import attention_backend_names
from msaserve.platform.config_deployments import DeploymentsConfig

# The registered attention backends (msaserve/kernels/backends/), an enum in the JSON schema.
AttentionBackendName = Literal[attention_backend_names()]

GiB = 1 << 30
MiB = 1 << 20


class StrictModel(BaseModel):
    """Unknown keys are errors: a typo in a YAML file must not be silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(StrictModel):
    spec: str = Field(
        "smollm2",
        min_length=1,
        description="Which model to serve: 'smollm2' (bundled SmolLM2-135M-Instruct GGUF), 'tiny' "
        "(random test preset), 'm3-proxy' (random preset with the M3 attention shape) or a path "
        "to a checkpoint directory / .gguf file.",
    )
    served_model_name: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="The name clients pass as `model`; defaults to 'msaserve/<spec>' for presets "
        "and the file or directory name for paths.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight and activation dtype; 'auto' is float32 on CPU, bfloat16 on CUDA."
    )
    attention_backend: AttentionBackendName = Field(
        "msa",
        description="'msa' picks the MSA kernels for the device (Triton on CUDA, the PyTorch "
        "reference on CPU); 'naive' / 'triton' force one; 'dense' is the SDPA baseline.",
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where the model deployment runs the engine.")

    def resolved_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.spec in ("smollm2", "tiny", "m3-proxy"):
            return f"msaserve/{self.spec}"
        return Path(self.spec).name.removesuffix(".gguf") or self.spec


class EngineSettings(StrictModel):
    num_pages: int | None = Field(
        None,
        ge=4,
        le=16_777_216,
        description="KV pages per replica; leave unset to size the pool from kv_cache_memory_bytes.",
    )
    max_model_len: int | None = Field(
        None,
        ge=16,
        le=4_194_304,
        description="Longest prompt + output in tokens; default: the engine's default (8192).",
    )
    kv_cache_memory_bytes: int | None = Field(
        None,
        ge=MiB,
        le=1 << 44,
        description="CPU only: bytes per replica for KV + index pages when num_pages is unset; default: the "
        "engine's default (1 GiB).",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="CUDA only: share of free GPU memory the KV pool may use."
    )
    max_num_seqs: int = Field(16, ge=1, le=4096, description="Sequences decoded together per step.")
    max_num_batched_tokens: int = Field(
        2048, ge=16, le=1_048_576, description="Token budget of one step (chunked prefill + decode)."
    )
    max_waiting: int = Field(
        64,
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
        description="Decode steps per scheduling round: above 1, a decode-only batch of greedy requests runs "
        "that many steps on the device with one host sync (tokens stream in bursts of up to this many).",
    )

    @model_validator(mode="after")
    def _one_pool_size(self) -> Self:
        if self.num_pages is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("engine: set num_pages or kv_cache_memory_bytes, not both")
        return self


class RouterConfig(StrictModel):
    policy: Literal["round_robin", "pow2", "prefix_affinity", "kv_aware"] = Field(
        "kv_aware",
        description="Replica choice for the model deployment. Every policy runs through the same "
        "msaserve.router request router, so comparisons differ only in the policy class.",
    )
    w_prefill: float = Field(
        1.0, ge=0.0, le=1e6, description="Cost weight of each page the replica would have to prefill."
    )
    w_decode: float = Field(
        0.1, ge=0.0, le=1e6, description="Cost weight of each active (decoding) page on the replica."
    )
    affinity_credit: float = Field(
        8.0, ge=0.0, le=1e9, description="Cost subtracted for the replica that holds the request's session."
    )
    imbalance_ratio: float = Field(
        2.0,
        ge=1.0,
        le=1000.0,
        description="Relative imbalance guard: with the absolute one, fall back to power-of-two "
        "choices when the most loaded replica carries more than this times the mean load.",
    )
    imbalance_min_load: int = Field(
        4, ge=0, le=1_000_000,
        description="Absolute imbalance guard: max minus min replica load (running + waiting "
        "sequences) must exceed this before the relative guard can trigger.",
    )
    stats_period_s: float = Field(
        1.0, gt=0.0, le=600.0, description="How often replicas report load (record_routing_stats)."
    )


class KVCacheConfig(StrictModel):
    enabled: bool = Field(False, description="Run the disaggregated KV cache service.")
    num_shards: int = Field(1, ge=1, le=1024, description="Actors the pages are sharded over by hash.")
    memory_bytes: int = Field(4 * GiB, ge=MiB, le=1 << 44, description="Host-memory bytes across all shards.")
    disk_path: str | None = Field(None, description="Directory of the disk tier; unset disables it.")
    disk_bytes: int = Field(
        0, ge=0, le=1 << 50, description="Disk-tier capacity in bytes (0 = no disk tier)."
    )
    max_sessions: int = Field(
        100_000, ge=1, le=1 << 32,
        description="Session records kept across all shards; past it the least recently updated "
        "unpinned records are evicted (pinned, live sessions never are).",
    )
    session_idle_unpin_s: float = Field(
        3600.0, ge=60.0, le=30 * 86400.0,
        description="A persisted session not updated for this long loses its pins: its record and pages "
        "become evictable; if it comes back it is pinned again and recomputes what was evicted.",
    )

    @model_validator(mode="after")
    def _disk_needs_path(self) -> Self:
        if self.disk_bytes > 0 and not self.disk_path:
            raise ValueError("kvcache.disk_bytes > 0 needs kvcache.disk_path")
        return self


class PreprocessLimits(StrictModel):
    max_image_bytes: int = Field(20 * MiB, ge=1024, le=1 << 32, description="Largest encoded image accepted.")
    max_image_pixels: int = Field(
        50_000_000, ge=64, le=178_956_970, description="Largest decoded image (width × height) accepted."
    )
    min_pixels: int = Field(
        3136, ge=64, le=1 << 28, description="Images are upscaled to at least this many pixels."
    )
    max_pixels: int = Field(
        1_003_520, ge=64, le=1 << 28, description="Images are downscaled to at most this many pixels."
    )
    max_video_bytes: int = Field(
        200 * MiB, ge=1024, le=1 << 36, description="Largest encoded video accepted."
    )
    video_fps: float = Field(2.0, gt=0.0, le=60.0, description="Frames sampled per second of video.")
    video_max_frames: int = Field(64, ge=2, le=4096, description="Most frames sampled from one video.")
    video_max_duration_s: float = Field(
        600.0, gt=0.0, le=86_400.0, description="Longest video accepted, in seconds."
    )
    max_items_per_request: int = Field(8, ge=0, le=1024, description="Images + videos in one request.")
    allow_file_urls: bool = Field(False, description="Accept file:// URLs (local deployments only).")
    allow_http_urls: bool = Field(
        False, description="Fetch http(s):// URLs (data: URLs are always accepted)."
    )
    allowed_hosts: list[str] = Field(
        default_factory=list, description="Hosts http(s) URLs may name; empty = any public host."
    )
    allow_private_addresses: bool = Field(
        False, description="Allow fetching from private, loopback and link-local addresses."
    )
    fetch_timeout_s: float = Field(10.0, gt=0.0, le=600.0, description="Time limit of one media fetch.")
    max_redirects: int = Field(3, ge=0, le=20, description="Redirects followed by one media fetch.")

    @model_validator(mode="after")
    def _pixel_range(self) -> Self:
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"preprocess.min_pixels={self.min_pixels} must be ≤ preprocess.max_pixels={self.max_pixels}"
            )
        return self


class AuthConfig(StrictModel):
    api_keys: list[str] = Field(
        default_factory=list,
        description="Accepted API keys (Authorization: Bearer <key>); with no keys from any source "
        "the API is open.",
    )
    api_keys_env: str | None = Field(
        None, description="Environment variable holding comma-separated API keys (e.g. from a Secret)."
    )
    api_keys_file: str | None = Field(None, description="File with one API key per line.")
    requests_per_minute: int | None = Field(
        None, ge=1, le=10_000_000, description="Per-key request rate limit; unset = unlimited."
    )
    max_concurrent_requests: int | None = Field(
        None, ge=1, le=1_000_000, description="Per-key in-flight request limit; unset = unlimited."
    )

    def resolve_keys(self) -> list[str]:
        """Every configured key from the list, the environment variable and the file."""
        import os

        keys = list(self.api_keys)
        if self.api_keys_env:
            keys += [k.strip() for k in os.environ.get(self.api_keys_env, "").split(",") if k.strip()]
        if self.api_keys_file:
            text = Path(self.api_keys_file).read_text()
            keys += [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
        return keys


class HttpConfig(StrictModel):
    host: str = Field("127.0.0.1", description="Address the Serve HTTP proxy binds (0.0.0.0 in clusters).")
    port: int = Field(8000, ge=1, le=65535, description="Port of the OpenAI-compatible API.")
    max_body_bytes: int = Field(
        32 * MiB, ge=1024, le=1 << 34, description="Largest request body; larger bodies get 413."
    )
    cors_origins: list[str] = Field(
        default_factory=list, description="Origins allowed by CORS; empty = CORS off."
    )
    request_timeout_s: float = Field(
        600.0, gt=0.0, le=86_400.0, description="Serve's end-to-end request timeout."
    )


class ServeConfig(StrictModel):
    """Everything `build_app` needs. Defaults serve SmolLM2 on CPU on 127.0.0.1:8000."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="Which model and where it runs.")
    engine: EngineSettings = Field(default_factory=EngineSettings, description="Per-replica engine limits.")
    deployments: DeploymentsConfig = Field(
        default_factory=DeploymentsConfig, description="Replicas and resources of each deployment."
    )
    router: RouterConfig = Field(
        default_factory=RouterConfig, description="How requests pick a model replica."
    )
    kvcache: KVCacheConfig = Field(default_factory=KVCacheConfig, description="The KV cache service.")
    preprocess: PreprocessLimits = Field(
        default_factory=PreprocessLimits, description="Limits of the media pipeline."
    )
    auth: AuthConfig = Field(default_factory=AuthConfig, description="API keys and per-key limits.")
    http: HttpConfig = Field(default_factory=HttpConfig, description="The HTTP front end.")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "ServeConfig":
        try:
            return cls.model_validate(data or {})
        except ValidationError as e:
            raise ConfigError(format_validation_error(e)) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ServeConfig":
        data = yaml.safe_load(Path(path).read_text())
        if data is not None and not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
        try:
            return cls.from_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


class ConfigError(ValueError):
    """A ServeConfig that failed validation; the message lists each bad field by dotted path."""


def format_validation_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        value = err.get("input")
        shown = "" if isinstance(value, dict) else f" (got {value!r})"
        lines.append(f"{where}: {err['msg']}{shown}")
    return "invalid ServeConfig: " + "; ".join(lines)
