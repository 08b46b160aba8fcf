"""The KV-aware policy (docs/design.md §4, router): send a request where its pages are, keep sessions
together, and keep load balanced.

    cost(r) = w_prefill · (miss_pages(r) + w_queue · min(queued_pages(r), queue_horizon_pages))
              + w_decode · active_pages(r)
              − affinity_credit   [r is the session's home and not overloaded]
              − index_credit      [the session's MSA index is resident on r]
              − family_credit     [r is the rendezvous home of the request's first page, which
                                   no replica holds]

`miss_pages(r)` is the request's pages that r does not hold (leading-prefix match on chained
hashes), `queued_pages(r)` the prefill already queued on r: the work before this request's first
token. The queue is priced up to a horizon (load adaptation): past it every replica has enough
work not to idle and only the work a miss adds still matters, so near and past capacity requests
stay with their prefixes instead of following the shortest of several long queues.
`family_credit` keeps a prefix family (requests whose first page is equal) together when no
replica is known to hold it: past capacity, KV pressure evicts prefixes before the router sees
them reused, and without a tie-break each miss of a family lands on a different replica, which
then all hold (and evict) copies; with it the family's next miss lands where the last one did and
finds the pages fresh. The home is rendezvous hashing (highest hash of replica id and page hash),
stable across router processes and balanced over families in expectation. It is a credit of a few
pages, not a rule: a family that is a large share of the traffic (a popular system prompt) is held
by several replicas, and then it does not apply.
`active_pages(r)` is pages held by r's live sequences (decode cost per step grows
with it, and it is KV pressure that evicts cached prefixes).

Overloaded replicas (they cannot fit the request in their free pages, or their load is past the
imbalance thresholds against the others) are skipped while another can take the request. A
session stays on its home replica unless that replica is overloaded, draining or dead; then the
request goes to the cheapest other replica and the decision says `session_moved`. When load
across replicas is imbalanced (both thresholds crossed, `policies.is_imbalanced`), the policy
falls back to power of two choices: the state it reasons about is then likely stale.

When the choice is full (Serve's queue-length probe), the ranking offers only replicas carrying at
most `spill_load_ratio` of its load; otherwise the request waits for its choice (`rank`).
"""

import dataclasses
import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

from msaserve.router.policies import (
    POLICY_CLASSES,
    Decision,
    Policy,
    Reason,
    is_imbalanced,
    pow2_choice,
    usable,
)
from msaserve.router.state import ReplicaState, RequestView, RouterState


@dataclass(frozen=True)
class KVAwareConfig:
    w_prefill: float = 1.0
    """Cost per page to prefill (the unit of cost)."""
    w_decode: float = 0.02
    """Cost per active page on the replica."""
    w_queue: float = 0.5
    """Weight of the prefill pages already queued on the replica, relative to this request's own
    (below 1: a miss adds work for everyone, queued work only delays; 0.5 chosen on the Mooncake
    trace in benchmarks/router/simulate.py)."""
    queue_horizon_pages: float = 32.0
    """Load adaptation: queued prefill is priced up to this many pages. Below it a queue is time
    this request waits; past it every candidate has work enough not to idle, and a miss only adds
    work that delays everyone behind it, so the prefix decides (32 pages of 512 tokens, with
    family_credit 8: chosen on the Mooncake trace at 4 replicas from 0 / 16 / 32 / 64 / 128 / 256
    once the simulated replicas admitted like the engine, checked on the agent-sessions trace and at
    8 replicas; docs/performance-router.md)."""
    spill_on_full_kv: bool = False
    """Whether a replica without free pages for the request counts as overloaded (skipped while
    another can take it; a session leaves it). Off: near capacity every replica's pages are full
    of running sequences, and spilling on it scattered sessions away from their prefixes."""
    affinity_credit: float = 16.0
    """Pages of prefill a session's home replica is credited with."""
    index_credit: float = 16.0
    """Pages credited where the session's MSA index is resident (KV cache service)."""
    family_credit: float = 8.0
    """Pages credited to the rendezvous home of the request's first page (see the module docstring).
    8 (picked on Mooncake, 4 replicas, near capacity, from 0 / 8 / 16): families stay on one replica
    instead of being copied onto several, which is what lets four caches hold more distinct
    prefixes. (It was off because on the agent-sessions trace, simulated with replicas that reserved
    every waiting request's pages, it overloaded the system prompts' homes; with engine-like
    admission, horizon 32 and family credit 8 together are neutral to slightly better there,
    docs/performance-router.md.)"""
    spill_load_ratio: float = 0.5
    """Fallbacks when the chosen replica cannot take the request now (Serve's queue-length probe:
    `max_ongoing_requests` reached): another replica is ranked only if its load is at most this
    fraction of the chosen one's, otherwise the request waits in the router for the chosen one.
    Past capacity every replica is full, and a spill to an equally loaded replica throws the
    prefix (or the session's context) away without queueing less. 1 or more: every replica is a
    fallback (the behaviour before), as with a choice of at most `imbalance_abs` sequences.
    0.5 set a priori, then checked on the agent-sessions trace (Mooncake never fills a queue of
    256): at 19.7 req/s, 4 replicas, 0.25 and 0.5 are sustained, 0.75 is not (1 is not already at
    17.9 req/s); at 39.3 req/s, 8 replicas, only 0.25 is (docs/performance-router.md)."""
    imbalance_abs: float = 16.0
    """Sequences: the guard needs max − min load above this…"""
    imbalance_rel: float = 3.0
    """…and max load above this multiple of the mean."""

    def __post_init__(self) -> None:
        for name in ("w_prefill", "w_decode", "w_queue", "affinity_credit", "index_credit", "family_credit",
                     "spill_load_ratio", "imbalance_abs"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: allowed a number ≥ 0")
        if self.imbalance_rel < 1.0:
            raise ValueError(f"imbalance_rel={self.imbalance_rel} is invalid: allowed a number ≥ 1.0")


class KVAwarePolicy(Policy):
    name = "kv_aware"

    def __init__(self, state: RouterState, rng: random.Random | None = None,
                 config: KVAwareConfig | None = None) -> None:
        super().__init__(state, rng)
        self.config = config or KVAwareConfig()

    @classmethod
    def from_config(cls, state: RouterState, rng: random.Random | None, config: KVAwareConfig) -> Policy:
        return cls(state, rng, config)

    def overloaded(self, r: ReplicaState, request: RequestView, candidates: Sequence[ReplicaState]) -> bool:
        """Too full to take this request without waiting, or far more loaded than the others."""
        if self.config.spill_on_full_kv and r.num_total_pages and r.free_pages < request.num_pages:
            return True
        others = [c.load for c in candidates if c.replica_id != r.replica_id]
        if not others:
            return False
        mean = (sum(others) + r.load) / (len(others) + 1)
        cfg = self.config
        return r.load - min(others) > cfg.imbalance_abs and r.load > cfg.imbalance_rel * mean

    def cost(self, r: ReplicaState, request: RequestView, now: float, home_ok: bool,
             family_home: str | None = None) -> tuple[float, int]:
        """(cost, predicted hit pages) of sending `request` to `r`."""
        cfg = self.config
        hit = r.hit_pages(request.page_hashes, now)
        miss = len(request.page_hashes) - hit
        queued = min(r.queued_prefill_pages(self.state.mean_miss_pages), cfg.queue_horizon_pages)
        prefill = miss + cfg.w_queue * queued
        cost = cfg.w_prefill * prefill + cfg.w_decode * r.active_pages
        if home_ok:
            cost -= cfg.affinity_credit
        if request.session_id is not None and request.session_id in r.resident_sessions:
            cost -= cfg.index_credit
        if family_home is not None and r.replica_id == family_home:
            cost -= cfg.family_credit
        return cost, hit

    def choose(self, request: RequestView, replicas: Sequence[ReplicaState], now: float) -> Decision:
        candidates = usable(replicas)
        if not candidates:
            raise ValueError("no live replica to route to: candidates were empty or all dead")
        home_id = self.state.sessions.get(request.session_id) if request.session_id else None
        home = next((r for r in candidates if r.replica_id == home_id), None)
        home_ok = home is not None and not home.draining and not self.overloaded(home, request, candidates)
        if is_imbalanced(candidates, self.config.imbalance_abs, self.config.imbalance_rel):
            if home_ok and home is not None:
                return Decision(home.replica_id, "session_affinity", home.hit_pages(request.page_hashes, now))
            chosen = pow2_choice(candidates, self.rng)
            reason: Reason = "session_moved" if home_id is not None else "imbalance_pow2"
            return Decision(chosen.replica_id, reason, chosen.hit_pages(request.page_hashes, now))
        # Spill-over: a replica that cannot take the request now is not considered while another can.
        eligible = [r for r in candidates if not self.overloaded(r, request, candidates)] or candidates
        scored = []
        family = self._family(request, eligible, now)
        for r in eligible:
            is_home = home_ok and r.replica_id == home_id
            cost, hit = self.cost(r, request, now, is_home, family)
            scored.append((cost, r.load, r.replica_id, hit))
        cost, _, chosen_id, hit = min(scored)
        return Decision(chosen_id, self._reason(home_id, chosen_id, hit), hit)

    def rank(self, request: RequestView, replicas: Sequence[ReplicaState], now: float) -> list[Decision]:
        """The choice, then (by load) only the replicas carrying at most `spill_load_ratio` of its
        load: when the choice is full the request spills to a replica that is clearly less busy, or
        waits for the choice. A choice with at most `imbalance_abs` sequences keeps every fallback
        (small loads say nothing about capacity, as for the imbalance guard)."""
        ranking = super().rank(request, replicas, now)
        load = {r.replica_id: r.load for r in replicas}
        chosen = load[ranking[0].replica_id]
        if self.config.spill_load_ratio >= 1.0 or chosen <= self.config.imbalance_abs:
            return ranking
        limit = self.config.spill_load_ratio * chosen
        return ranking[:1] + [d for d in ranking[1:] if load[d.replica_id] <= limit]

    def _family(self, request: RequestView, eligible: Sequence[ReplicaState], now: float) -> str | None:
        """The family home to credit: only for a request no eligible replica holds a page of (a
        family the router has lost track of), so a held prefix or a session is never pulled away."""
        if not self.config.family_credit or not request.page_hashes:
            return None
        if any(r.holds(request.page_hashes[0], now) for r in eligible):
            return None
        return family_home(request, eligible)

    @staticmethod
    def _reason(home_id: str | None, chosen_id: str, hit: int) -> Reason:
        if home_id is not None:
            return "session_affinity" if chosen_id == home_id else "session_moved"
        return "prefix_hit" if hit > 0 else "least_cost"


def family_home(request: RequestView, replicas: Sequence[ReplicaState]) -> str | None:
    """Rendezvous home of the request's first page: the replica with the highest hash of
    (replica id, first page hash); None without pages."""
    if not request.page_hashes or not replicas:
        return None
    first = request.page_hashes[0]

    def weight(r: ReplicaState) -> bytes:
        return hashlib.blake2b(f"{r.replica_id}:{first}".encode(), digest_size=8).digest()

    return max(replicas, key=weight).replica_id


POLICIES = tuple(POLICY_CLASSES)
"""The product's policies (registered by the classes of policies.py and this module), the names
ServeConfig's `router.policy` accepts."""


def make_policy(name: str, state: RouterState, rng: random.Random | None = None, *,
                kv_aware: KVAwareConfig | None = None, imbalance_abs: float | None = None,
                imbalance_rel: float | None = None) -> Policy:
    """The policy registered under `name`, built from the cost-model settings (imbalance_* override
    the config's guard)."""
    cls = POLICY_CLASSES.get(name)
    if cls is None:
        raise ValueError(f"router.policy={name!r} is invalid: allowed {', '.join(POLICY_CLASSES)}")
    cfg = kv_aware or KVAwareConfig()
    if imbalance_abs is not None:
        cfg = dataclasses.replace(cfg, imbalance_abs=imbalance_abs)
    if imbalance_rel is not None:
        cfg = dataclasses.replace(cfg, imbalance_rel=imbalance_rel)
    return cls.from_config(state, rng, cfg)
