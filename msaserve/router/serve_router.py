"""The Ray Serve request router of the model deployment (Ray Serve 2.60 public API).

Use it through `request_router_config(...)`, which maps ServeConfig's `router` section:

    ServeConfig router field       -> where it goes
    policy                         -> request_router_kwargs["policy"]
                                      (round_robin | pow2 | prefix_affinity | kv_aware)
    w_prefill, w_decode            -> request_router_kwargs["w_prefill"], ["w_decode"]
    affinity_credit                -> request_router_kwargs["affinity_credit"]
    imbalance_abs, imbalance_rel   -> request_router_kwargs["imbalance_abs"], ["imbalance_rel"]
    stats_period_s                 -> RequestRouterConfig.request_routing_stats_period_s, and
                                      request_router_kwargs["estimate_expiry_s"] = 4 × stats_period_s
    (engine) page_size             -> request_router_kwargs["page_size"]  (must equal the engine's)

    deployment.options(request_router_config=request_router_config(page_size=..., **router_section))

Class path: `msaserve.router.serve_router.MSARequestRouter` (ROUTER_CLASS_PATH). Other kwargs
`initialize_state` accepts: w_queue, index_credit, default_max_tokens, seed.

The model deployment must (a) take the request as the first positional argument of its
generate method (`GenerateRequest`, or a dict with prompt_token_ids / session_id / max_tokens —
see `core.request_view`), and (b) define `record_routing_stats()` returning
`stats.routing_stats_payload(...)`. Without payloads the router still works from its own
estimates of what it sent where.

Metrics (ray.util.metrics, visible as `ray_<name>`): msaserve_router_decisions{policy,reason},
msaserve_router_predicted_hit_pages / msaserve_router_prompt_pages (predicted hit rate = ratio),
msaserve_router_replica_prefix_hit_rate{replica} (actual, as the engine reports it),
msaserve_router_load_imbalance (max / mean load over replicas).
"""

from typing import Any

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from ray.util import metrics

from msaserve.router.core import DecisionLog, RouterCore
from msaserve.router.kv_aware import KVAwareConfig
from msaserve.router.policies import Decision
from msaserve.router.state import RequestView

ROUTER_CLASS_PATH = "msaserve.router.serve_router.MSARequestRouter"


def request_router_config(*, page_size: int, policy: str = "kv_aware", w_prefill: float = 1.0,
                          w_decode: float = 0.02, affinity_credit: float = 16.0, imbalance_abs: float = 16.0,
                          imbalance_rel: float = 2.0, stats_period_s: float = 1.0,
                          **extra: Any) -> RequestRouterConfig:
    """The deployment's router config from ServeConfig's router section (see module docstring)."""
    kwargs = {"policy": policy, "page_size": page_size, "w_prefill": w_prefill, "w_decode": w_decode,
              "affinity_credit": affinity_credit, "imbalance_abs": imbalance_abs,
              "imbalance_rel": imbalance_rel, "estimate_expiry_s": 4 * stats_period_s, **extra}
    _validate_kwargs(kwargs)
    return RequestRouterConfig(request_router_class=ROUTER_CLASS_PATH, request_router_kwargs=kwargs,
                               request_routing_stats_period_s=stats_period_s)


def _validate_kwargs(kwargs: dict[str, Any]) -> tuple[RouterCore, dict[str, Any]]:
    """Build the core once so that a bad value fails at config time, naming the field."""
    known = {"policy", "page_size", "estimate_expiry_s", "default_max_tokens", "seed"}
    cfg_fields = set(KVAwareConfig.__dataclass_fields__)
    unknown = set(kwargs) - known - cfg_fields
    if unknown:
        raise ValueError(f"request_router_kwargs has unknown keys {sorted(unknown)}: allowed "
                         f"{sorted(known | cfg_fields)}")
    cfg = KVAwareConfig(**{k: v for k, v in kwargs.items() if k in cfg_fields})
    core = RouterCore(kwargs.get("policy", "kv_aware"), kwargs.get("page_size", 128), kv_aware=cfg,
                      estimate_expiry_s=kwargs.get("estimate_expiry_s", 30.0),
                      default_max_tokens=kwargs.get("default_max_tokens", 256), seed=kwargs.get("seed"))
    return core, kwargs


class RayMetrics(DecisionLog):
    """DecisionLog that also exports through ray.util.metrics."""

    def __init__(self, deployment: str) -> None:
        super().__init__()
        tags = ("deployment", "policy")
        self._decisions = metrics.Counter("msaserve_router_decisions", "Routing decisions by reason.",
                                          tag_keys=(*tags, "reason"))
        self._predicted = metrics.Counter("msaserve_router_predicted_hit_pages",
                                          "Prompt pages the router predicted to be cached.", tag_keys=tags)
        self._prompt = metrics.Counter("msaserve_router_prompt_pages", "Prompt pages routed.", tag_keys=tags)
        self._hit_rate = metrics.Gauge("msaserve_router_replica_prefix_hit_rate",
                                       "Prefix hit rate each replica reports.",
                                       tag_keys=("deployment", "replica"))
        self._imbalance = metrics.Gauge("msaserve_router_load_imbalance",
                                        "Max over mean running+waiting sequences.", tag_keys=("deployment",))
        self._deployment = deployment

    def decision(self, policy: str, decision: Decision, prompt_pages: int) -> None:
        super().decision(policy, decision, prompt_pages)
        tags = {"deployment": self._deployment, "policy": policy}
        self._decisions.inc(1, tags={**tags, "reason": decision.reason})
        if decision.predicted_hit_pages:
            self._predicted.inc(decision.predicted_hit_pages, tags=tags)
        if prompt_pages:
            self._prompt.inc(prompt_pages, tags=tags)

    def spilled(self, policy: str) -> None:
        super().spilled(policy)
        self._decisions.inc(1, tags={"deployment": self._deployment, "policy": policy, "reason": "spilled"})

    def replica_hit_rate(self, replica_id: str, hit_rate: float) -> None:
        super().replica_hit_rate(replica_id, hit_rate)
        self._hit_rate.set(hit_rate, tags={"deployment": self._deployment, "replica": replica_id})

    def imbalance(self, value: float) -> None:
        super().imbalance(value)
        self._imbalance.set(value, tags={"deployment": self._deployment})


def _rid(replica_id: ReplicaID) -> str:
    return replica_id.unique_id


class MSARequestRouter(RequestRouter):
    """Adapts Serve's hooks to `RouterCore`. No FIFOMixin: the replica chosen for a request must
    serve that request (Serve's default out-of-order matching by internal request id)."""

    def initialize_state(self, **kwargs: Any) -> None:
        core, _ = _validate_kwargs(kwargs)
        core.log = RayMetrics(self._deployment_id.name)
        self._core = core

    def _router_core(self) -> RouterCore:
        core = getattr(self, "_core", None)
        if core is None:  # constructed without kwargs: Serve skips initialize_state when empty
            self.initialize_state()
            core = self._core
        return core

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        core = self._router_core()
        core.refresh([(_rid(r.replica_id), r.routing_stats or {}) for r in candidate_replicas])
        by_id = {_rid(r.replica_id): r for r in candidate_replicas}
        if pending_request is None:
            ranking = core.policy.rank(RequestView("", (), 1), [core.state.replica(i) for i in by_id],
                                      core.clock())
        else:
            # One ranking covers every candidate: if all are full, back off before re-ranking.
            pending_request.routing_context.should_backoff = True
            ranking = core.rank(pending_request.args, pending_request.kwargs,
                                pending_request.metadata.internal_request_id, list(by_id))
        return [[by_id[d.replica_id]] for d in ranking]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._router_core().routed(pending_request.metadata.internal_request_id, _rid(replica_id))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._router_core().sync([_rid(r.replica_id) for r in replicas])

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._router_core().replica_died(_rid(replica_id))

