"""Replicas, autoscaling and Ray resources of each Serve deployment (part of `ServeConfig`)."""

from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class AutoscalingSettings(_Strict):
    min_replicas: int = Field(1, ge=0, le=10_000, description="Fewest replicas (0 allows scale to zero).")
    max_replicas: int = Field(1, ge=1, le=10_000, description="Most replicas.")
    target_ongoing_requests: float = Field(
        4.0, gt=0.0, le=100_000.0, description="In-flight requests per replica the autoscaler aims for."
    )

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"autoscaling.min_replicas={self.min_replicas} must be ≤ max_replicas={self.max_replicas}"
            )
        return self

    def to_serve(self) -> dict[str, Any]:
        return self.model_dump()


class ActorOptions(_Strict):
    num_cpus: float = Field(1.0, ge=0.0, le=1024.0, description="CPUs reserved per replica.")
    num_gpus: float = Field(
        0.0, ge=0.0, le=64.0, description="GPUs reserved per replica (fractions allowed)."
    )
    memory: int | None = Field(
        None, ge=0, le=1 << 44, description="Bytes of memory reserved per replica; unset = no reservation."
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources per replica, e.g. {'msaserve_kvcache_group': 1} to pin "
        "replicas to the worker group the Helm chart advertises that resource on.",
    )

    @field_validator("resources")
    @classmethod
    def _resources_positive(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if not name or not 0.0 < amount <= 1e6:
                raise ValueError(
                    f"resources[{name!r}]={amount} is invalid: allowed a name and 0 < amount ≤ 1e6"
                )
        return value

    def to_serve(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump().items() if v is not None and v != {}}


class DeploymentSettings(_Strict):
    num_replicas: int | None = Field(
        1, ge=0, le=10_000, description="Fixed replica count; set to null when autoscaling is used."
    )
    autoscaling: AutoscalingSettings | None = Field(
        None, description="Autoscaling bounds; replaces num_replicas when set."
    )
    max_ongoing_requests: int = Field(
        64, ge=1, le=1_000_000, description="In-flight requests one replica accepts before Serve queues."
    )
    ray_actor_options: ActorOptions = Field(
        default_factory=ActorOptions, description="Ray resources of each replica."
    )

    @model_validator(mode="after")
    def _replicas_or_autoscaling(self) -> Self:
        if self.autoscaling is not None and self.num_replicas not in (None, 1):
            raise ValueError("set num_replicas or autoscaling, not both (num_replicas must be null)")
        return self

    def to_serve_options(self) -> dict[str, Any]:
        """Keyword arguments for `Deployment.options(...)`."""
        opts: dict[str, Any] = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "ray_actor_options": self.ray_actor_options.to_serve(),
        }
        if self.autoscaling is not None:
            opts["autoscaling_config"] = self.autoscaling.to_serve()
        else:
            opts["num_replicas"] = self.num_replicas if self.num_replicas is not None else 1
        return opts


def _gateway() -> DeploymentSettings:
    return DeploymentSettings(max_ongoing_requests=256, ray_actor_options=ActorOptions(num_cpus=0.5))


def _model() -> DeploymentSettings:
    return DeploymentSettings(max_ongoing_requests=128, ray_actor_options=ActorOptions(num_cpus=1.0))


def _small() -> DeploymentSettings:
    return DeploymentSettings(ray_actor_options=ActorOptions(num_cpus=0.5))


class DeploymentsConfig(_Strict):
    gateway: DeploymentSettings = Field(
        default_factory=_gateway, description="The FastAPI ingress (auth, validation, streaming)."
    )
    model: DeploymentSettings = Field(
        default_factory=_model, description="Engine replicas (set ray_actor_options.num_gpus on clusters)."
    )
    preprocess: DeploymentSettings = Field(default_factory=_small, description="CPU media pipeline replicas.")
    kvcache: DeploymentSettings = Field(
        default_factory=_small, description="KV cache service replicas (see kvcache.num_shards)."
    )
