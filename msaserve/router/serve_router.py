"""The Ray Serve request router of the model deployment (Ray Serve 2.60 public API).

Class path: `msaserve.router.serve_router.MSARequestRouter` (ROUTER_CLASS_PATH). Serve passes
`RequestRouterConfig.request_router_kwargs` to `initialize_state`; it accepts ServeConfig's
`router` section as is (`RouterConfig.model_dump()`, what `platform/app.py` passes):

    ServeConfig router field  -> effect
    policy                    -> round_robin | pow2 | prefix_affinity | kv_aware (policies.py, kv_aware.py)
    w_prefill                 -> KVAwareConfig.w_prefill: cost per page to prefill on the replica
    w_decode                  -> KVAwareConfig.w_decode: cost per active page on the replica
    affinity_credit           -> KVAwareConfig.affinity_credit: pages credited to a session's home
    spill_load_ratio          -> KVAwareConfig.spill_load_ratio: fallbacks ranked after the choice carry
                                 at most this fraction of its load (else the request waits for it)
    imbalance_min_load        -> KVAwareConfig.imbalance_abs: the guard needs max − min load (running +
                                 waiting sequences) above this ...
    imbalance_ratio           -> KVAwareConfig.imbalance_rel: ... and max load above this × the mean
    stats_period_s            -> estimate_expiry_s = max(10 s, 4 × stats_period_s) (how long a routed
                                 request's pages count as cached without a KV event); the caller sets
                                 RequestRouterConfig.request_routing_stats_period_s = stats_period_s

Also accepted: the KVAwareConfig names themselves (imbalance_abs, imbalance_rel, w_queue,
index_credit, family_credit), page_size (the engine's; when absent it is learned from the payloads, see
core.RouterCore), estimate_expiry_s, default_max_tokens, seed. Unknown keys fail at config time.
`request_router_config(router_section)` builds the whole RequestRouterConfig.

The model deployment must (a) take the request as the first positional argument of its
generate method (`GenerateRequest`, or a dict with prompt_token_ids / session_id / max_tokens —
see `core.request_view`), (b) define `record_routing_stats()` returning
`stats.routing_stats_payload(...)` (with `page_size=engine.page_size`), and (c) define
`routing_snapshot(target)` returning `recorder.snapshot_payload(...)`. Without payloads the router
still works from its own estimates of what it sent where.

KV events: every payload Serve broadcasts is applied when it arrives (`update_replicas`), not only
when a request is routed, and missed payloads are replayed from the payload's journal. When that
cannot close a gap (or the view fails the replica's checksum) the router asks that replica for a
snapshot: a `routing_snapshot` call through a handle to the deployment, which this router class
sends to the replica named in its argument (`core.ROUTING_TARGET`), answered on a worker thread
and applied on the router's loop.

Metrics (ray.util.metrics, exported as `ray_<name>`): msaserve_router_decisions{policy,reason},
msaserve_router_predicted_hit_pages / msaserve_router_prompt_pages (predicted hit rate = ratio),
msaserve_router_replica_prefix_hit_rate{replica} (actual, as the engine reports it),
msaserve_router_load_imbalance (max / mean load over replicas).
"""

import asyncio
import contextlib
import gc
import logging
import threading
from collections.abc import Mapping
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from ray.util import metrics

from msaserve.router.core import ROUTING_TARGET, DecisionLog, RouterCore
from msaserve.router.kv_aware import KVAwareConfig
from msaserve.router.policies import Decision
from msaserve.router.state import RequestView, estimate_expiry_for

ROUTER_CLASS_PATH = "msaserve.router.serve_router.MSARequestRouter"
SNAPSHOT_TIMEOUT_S = 10.0
logger = logging.getLogger("ray.serve.msaserve.router")


def live_cores() -> list[RouterCore]:
    """The cores of this process's MSARequestRouters (tests and benchmarks read the router's
    view and decisions through them). Found by type name: Serve may load the class by value
    (cloudpickle), so a class attribute or module global of this module is not reliably shared."""
    routers = [o for o in gc.get_objects() if type(o).__name__ == "MSARequestRouter"]
    return [r._core for r in routers if getattr(r, "_core", None) is not None]


_SNAPSHOT_HANDLES: dict[tuple[str, str], Any] = {}
"""One handle per deployment and process for snapshot calls: its own router (another
MSARequestRouter) resyncs through the same handle instead of creating routers without end."""


def request_router_config(router: Mapping[str, Any], page_size: int | None = None) -> RequestRouterConfig:
    """The model deployment's RequestRouterConfig from ServeConfig's router section (a dict)."""
    kwargs = dict(router)
    if page_size is not None:
        kwargs["page_size"] = page_size
    build_core(kwargs)  # fail at config time, naming the field
    return RequestRouterConfig(request_router_class=ROUTER_CLASS_PATH, request_router_kwargs=kwargs,
                               request_routing_stats_period_s=float(kwargs.get("stats_period_s", 1.0)))


PLATFORM_ALIASES = {"imbalance_ratio": "imbalance_rel", "imbalance_min_load": "imbalance_abs"}
"""ServeConfig's RouterConfig field names (app.router_config passes `router.model_dump()`)."""


def build_core(kwargs: Mapping[str, Any]) -> RouterCore:
    """Build the core once so that a bad value fails at config time, naming the field."""
    kwargs = {PLATFORM_ALIASES.get(k, k): v for k, v in kwargs.items()}
    if "stats_period_s" in kwargs:
        kwargs.setdefault("estimate_expiry_s", estimate_expiry_for(float(kwargs.pop("stats_period_s"))))
    known = {"policy", "page_size", "estimate_expiry_s", "default_max_tokens", "seed"}
    cfg_fields = set(KVAwareConfig.__dataclass_fields__)
    unknown = set(kwargs) - known - cfg_fields
    if unknown:
        raise ValueError(f"request_router_kwargs has unknown keys {sorted(unknown)}: allowed "
                         f"{sorted(known | cfg_fields | set(PLATFORM_ALIASES) | {'stats_period_s'})}")
    cfg = KVAwareConfig(**{k: v if isinstance(v, bool) else float(v)
                           for k, v in kwargs.items() if k in cfg_fields})
    core = RouterCore(kwargs.get("policy", "kv_aware"), kwargs.get("page_size"), kv_aware=cfg,
                      estimate_expiry_s=kwargs.get("estimate_expiry_s", 30.0),
                      default_max_tokens=kwargs.get("default_max_tokens", 256), seed=kwargs.get("seed"))
    return core


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

    queue_len_response_deadline_s = 0.5
    """Serve probes the first-ranked replica's queue length before sending; one that does not
    answer within this deadline is skipped for the next rank. Serve's 0.1 s default makes a busy
    replica (CPU engines, a loaded host) lose requests whose pages it holds."""

    def initialize_state(self, **kwargs: Any) -> None:
        core = build_core(kwargs)
        core.log = RayMetrics(self._deployment_id.name)
        core.resync = self._request_snapshot
        self._core = core
        self._loop: asyncio.AbstractEventLoop | None = None

    def _request_snapshot(self, replica_id: str) -> None:
        """core.resync: fetch the replica's snapshot off the router's loop (a blocking call)."""
        with contextlib.suppress(RuntimeError):
            self._loop = asyncio.get_running_loop()
        threading.Thread(target=self._fetch_snapshot, args=(replica_id,), daemon=True,
                         name=f"msaserve-resync-{replica_id}").start()

    def _fetch_snapshot(self, replica_id: str) -> None:
        payload = None
        try:
            key = (self._deployment_id.app_name, self._deployment_id.name)
            handle = _SNAPSHOT_HANDLES.get(key)
            if handle is None:
                handle = _SNAPSHOT_HANDLES[key] = serve.get_deployment_handle(key[1], app_name=key[0])
            payload = handle.routing_snapshot.remote({ROUTING_TARGET: replica_id}).result(
                timeout_s=SNAPSHOT_TIMEOUT_S)
        except Exception as e:  # the replica died or is busy: the next gap asks again
            logger.warning("routing snapshot of replica %s failed: %s", replica_id, e)
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._core.snapshot_arrived, replica_id, payload)
        else:
            self._core.snapshot_arrived(replica_id, payload)

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
        self._loop = asyncio.get_running_loop()
        core.refresh([(_rid(r.replica_id), r.routing_stats or {}) for r in candidate_replicas])
        by_id = {_rid(r.replica_id): r for r in candidate_replicas}
        if pending_request is None:
            ranking = core.policy.rank(RequestView("", (), 1), [core.state.replica(i) for i in by_id],
                                      core.clock())
        else:
            # One ranking covers every candidate: if all are full, back off before re-ranking.
            pending_request.routing_context.should_backoff = True
            metadata = pending_request.metadata
            ranking = core.rank(pending_request.args, pending_request.kwargs, metadata.internal_request_id,
                                list(by_id), session_id=getattr(metadata, "session_id", None) or None)
        return [[by_id[d.replica_id]] for d in ranking]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._router_core().routed(pending_request.metadata.internal_request_id, _rid(replica_id))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        core = self._router_core()
        core.sync([_rid(r.replica_id) for r in replicas])
        # Every broadcast carries each replica's latest payload: apply it now, not at the next
        # routing call, so that no payload is skipped between two requests.
        core.refresh([(_rid(r.replica_id), r.routing_stats or {}) for r in replicas])

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._router_core().replica_died(_rid(replica_id))

