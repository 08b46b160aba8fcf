"""`ServeConfig`: the one user-facing description of a deployment (docs/design.md §4, platform).

Loaded from YAML (`msaserve serve --config FILE`), passed as `args` to the Serve application
builder (`msaserve.platform.app:app_builder`), and rendered into the Helm chart's serveConfigV2.
Every field carries a description and bounds; a bad value fails with the field's dotted path, the
value and the allowed range (`ServeConfig.from_yaml` formats pydantic's errors that way).
"""

import reprlib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from msaserve.engine.config import attention_backend_names
from msaserve.engine.settings import EngineSettings
from msaserve.kvcache.config import KVCacheConfig
from msaserve.platform.client_address import parse_networks
from msaserve.platform.config_deployments import DeploymentsConfig
from msaserve.preprocess.limits import PreprocessLimits
from msaserve.router.config import RouterConfig

# The registered attention backends (msaserve/kernels/backends/), an enum in the JSON schema.
AttentionBackendName = Literal[attention_backend_names()]

GiB = 1 << 30
MiB = 1 << 20


NAMED_SPECS = ("smollm2", "tiny", "m3-proxy", "m3-mini")
"""model.spec values that name a bundled model or a preset rather than a path."""


class StrictModel(BaseModel):
    """Unknown keys are errors: a typo in a YAML file must not be silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(StrictModel):
    spec: str = Field(
        "smollm2",
        min_length=1,
        description="Which model to serve: 'smollm2' (bundled SmolLM2-135M-Instruct GGUF), 'tiny' "
        "(random test preset), 'm3-proxy' (random preset with the M3 attention shape), 'm3-mini' "
        "(MiniMax-M3's text model at real widths, 4 layers, random weights: ≈ 50 GB in bf16, for a GPU) "
        "or a path to a checkpoint directory / .gguf file.",
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
        description="'msa' picks the MSA kernels for the device (Triton on CUDA; on CPU the compiled "
        "C kernels, or vectorised PyTorch without a compiler); 'naive' (the spec) / 'triton' force one; "
        "'dense' is the fastest dense attention for the device.",
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where the model deployment runs the engine.")

    def resolved_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.spec in NAMED_SPECS:
            return f"msaserve/{self.spec}"
        return Path(self.spec).name.removesuffix(".gguf") or self.spec


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
    admin_api_keys: list[str] = Field(
        default_factory=list,
        description="Keys that may also list every tenant's sessions (GET /v1/sessions); they are "
        "accepted as API keys too. A tenant is an API key: its sessions, KV pages and prefix-cache "
        "hits are private to it.",
    )
    share_prefix_cache: bool = Field(
        False,
        description="Let all API keys share prefix-cache pages (more hits for common system prompts) at "
        "the price of a timing side channel: a key can tell from a fast first token that another "
        "key sent the same prefix. Off by default: each key's page-hash chain starts at its own root.",
    )

    @field_validator("api_keys", "admin_api_keys")
    @classmethod
    def _presentable(cls, keys: list[str]) -> list[str]:
        """A key no client can present (empty, blank-edged: the header's token is stripped, or with a
        control character no header may hold) left its owner at 401 with nothing to say why."""
        for i, key in enumerate(keys):
            if not key or key != key.strip() or not key.isprintable():
                raise ValueError(  # the key itself is a secret: named by its place, never quoted
                    f"key [{i}] ({len(key)} characters) can never be sent as 'Authorization: Bearer <key>': "
                    "allowed a non-empty key of printable characters without leading or trailing whitespace"
                )
        return keys

    def resolve_keys(self) -> list[str]:
        """Every configured key from the list, the environment variable and the file."""
        import os

        keys = list(self.api_keys) + list(self.admin_api_keys)
        if self.api_keys_env:
            keys += [k.strip() for k in os.environ.get(self.api_keys_env, "").split(",") if k.strip()]
        if self.api_keys_file:
            text = Path(self.api_keys_file).read_text()
            lines = [line.strip() for line in text.splitlines()]
            keys += [line for line in lines if line and not line.startswith("#")]  # "  # note" too
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
    keep_alive_timeout_s: int = Field(
        5, ge=1, le=3600,
        description="An idle keep-alive connection is closed after this long (Serve's default is 90 s).",
    )
    header_timeout_s: float = Field(
        10.0, gt=0.0, le=600.0,
        description="A connection must complete a request's headers within this long of opening (or of "
        "its previous response), else 408 and closed (slowloris). Enforced in `msaserve serve`'s proxy.",
    )
    body_read_timeout_s: float = Field(
        30.0, gt=0.0, le=3600.0,
        description="The whole request body must arrive within this long of the headers, else 408.",
    )
    max_requests: int = Field(
        1024, ge=1, le=1_000_000,
        description="Requests in flight (streams included) per proxy / gateway process; beyond it 503.",
    )
    max_requests_per_client: int = Field(
        64, ge=1, le=1_000_000,
        description="Requests in flight from one client address; beyond it 429.",
    )
    trusted_proxies: list[str] = Field(
        default_factory=list,
        description="Addresses or CIDR networks of proxies (load balancer, ingress) whose X-Forwarded-For "
        "names the client for max_requests_per_client; empty = the header is never trusted, the TCP peer "
        "is the client. Also uvicorn's FORWARDED_ALLOW_IPS in `msaserve serve`'s proxy.",
    )
    ready_probe_timeout_s: float = Field(
        10.0, gt=0.0, le=600.0,
        description="GET /ready is 200 only if a model replica answered a 1-token probe within this long.",
    )
    ready_cache_s: float = Field(
        2.0, ge=0.0, le=600.0, description="A successful /ready probe is reused for this long."
    )
    metrics_open: bool = Field(
        False, description="Serve GET /metrics (Prometheus text) without an API key; by default it needs one."
    )

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, entries: list[str]) -> list[str]:
        parse_networks(entries)  # ValueError naming the bad entry and what is allowed
        return entries


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
        try:
            data = yaml.safe_load(Path(path).read_text())
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the config file: {e.strerror or e}") from None
        except yaml.YAMLError as e:  # its message names the line and column
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
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


# A rejected value as the message quotes it: nested and long values abbreviated while the repr is
# built, then cut to _SHOWN_CHARS. YAML anchors repeat a value by reference, so a 1 KB file can stand
# for a list of billions of items; repr() of it whole made an error message of 87 MB from eight
# nested aliases.
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxtuple, _SHOWN.maxset = 2, 6, 6, 6
_SHOWN.maxstring = _SHOWN.maxother = _SHOWN.maxlong = 120
_SHOWN_CHARS = 200


_SECRET_FIELDS = frozenset({"api_keys", "admin_api_keys"})
"""Fields whose values an error never quotes: `auth.api_keys: ... (got ['k1', ...])` printed every
key of the list to the terminal and the logs."""


def format_validation_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        value = err.get("input")
        shown = ""
        if not isinstance(value, dict) and _SECRET_FIELDS.isdisjoint(str(p) for p in err["loc"]):
            text = _SHOWN.repr(value)
            shown = f" (got {text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + '…'})"
        lines.append(f"{where}: {err['msg']}{shown}")
    return "invalid ServeConfig: " + "; ".join(lines)
