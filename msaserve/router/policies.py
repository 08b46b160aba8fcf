"""Routing policies: pure classes over `RouterState`, shared by the live router and the simulator.

Every policy answers `choose(request, replicas) -> Decision`: `replicas` are the candidates Serve
offers right now (their `ReplicaState`s); the policy never mutates state — the caller records the
decision with `RouterState.on_routed` — so the same object can be asked for a ranking
(`rank`) as well as a single choice.

Policies: `round_robin`, `pow2` (power of two choices on load), `prefix_affinity` (longest cached
prefix unless load is imbalanced, the approach of Ray Serve LLM's PrefixCacheAffinityRouter), and
`kv_aware` (the cost model, `kv_aware.py`).
"""

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from msaserve.router.state import ReplicaState, RequestView, RouterState

Reason = Literal[
    "round_robin", "pow2", "prefix_hit", "least_load", "least_cost", "session_affinity",
    "session_moved", "imbalance_pow2", "only_candidate",
]
REASONS: tuple[str, ...] = Reason.__args__  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Decision:
    replica_id: str
    reason: Reason
    predicted_hit_pages: int = 0
    """Leading prompt pages the router expects the replica to have cached."""


POLICY_CLASSES: dict[str, type["Policy"]] = {}
"""Every policy class by its `name`, registered when the class is defined: adding a policy is one
new class (`kv_aware.make_policy` builds the one a config names)."""


class Policy:
    """Base: holds the shared state and a seeded RNG (injected so that tests are deterministic)."""

    name = "base"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            POLICY_CLASSES[cls.name] = cls

    def __init__(self, state: RouterState, rng: random.Random | None = None) -> None:
        self.state = state
        self.rng = rng or random.Random()

    @classmethod
    def from_config(cls, state: RouterState, rng: random.Random | None, config: Any) -> "Policy":
        """Build from the router's cost-model settings (`kv_aware.KVAwareConfig`); policies that
        need none ignore them."""
        return cls(state, rng)

    def choose(self, request: RequestView, replicas: Sequence[ReplicaState], now: float) -> Decision:
        raise NotImplementedError

    def rank(self, request: RequestView, replicas: Sequence[ReplicaState], now: float) -> list[Decision]:
        """All candidates, preferred first: the choice, then the rest by load. Serve tries them in
        order when the first one's queue is full."""
        first = self.choose(request, replicas, now)
        rest = sorted((r for r in replicas if r.replica_id != first.replica_id), key=_load_key)
        return [first] + [Decision(r.replica_id, "least_load", r.hit_pages(request.page_hashes, now))
                          for r in rest]


def usable(replicas: Sequence[ReplicaState]) -> list[ReplicaState]:
    """Alive, non-draining replicas; all alive ones if every replica is draining (still serve)."""
    alive = [r for r in replicas if r.alive]
    open_ = [r for r in alive if not r.draining]
    return open_ or alive


def _load_key(r: ReplicaState) -> tuple[int, int, str]:
    return (r.load, r.active_pages, r.replica_id)


def _check(replicas: Sequence[ReplicaState]) -> list[ReplicaState]:
    candidates = usable(replicas)
    if not candidates:
        raise ValueError("no live replica to route to: candidates were empty or all dead")
    return candidates


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self, state: RouterState, rng: random.Random | None = None) -> None:
        super().__init__(state, rng)
        self._next = 0

    def choose(self, request: RequestView, replicas: Sequence[ReplicaState], now: float) -> Decision:
        candidates = sorted(_check(replicas), key=lambda r: r.replica_id)
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return Decision(chosen.replica_id, "round_robin", chosen.hit_pages(request.page_hashes, now))


def pow2_choice(candidates: Sequence[ReplicaState], rng: random.Random) -> ReplicaState:
    """Two distinct random candidates; the less loaded wins (ties: fewer active pages)."""
    if len(candidates) == 1:
        return candidates[0]
    a, b = rng.sample(list(candidates), 2)
    return min(a, b, key=_load_key)


class Pow2Policy(Policy):
    name = "pow2"

    def choose(self, request: RequestView, replicas: Sequence[ReplicaState], now: float) -> Decision:
        candidates = _check(replicas)
        chosen = pow2_choice(candidates, self.rng)
        reason: Reason = "pow2" if len(candidates) > 1 else "only_candidate"
        return Decision(chosen.replica_id, reason, chosen.hit_pages(request.page_hashes, now))


def is_imbalanced(candidates: Sequence[ReplicaState], abs_threshold: float, rel_threshold: float) -> bool:
    """Both thresholds must be crossed: max − min load above `abs_threshold` sequences (so that
    tiny loads never trip it) and max above `rel_threshold` × mean (so that large, evenly spread
    loads never trip it)."""
    loads = [r.load for r in candidates]
    mean = sum(loads) / len(loads)
    return max(loads) - min(loads) > abs_threshold and max(loads) > rel_threshold * mean


class PrefixAffinityPolicy(Policy):
    """Longest cached prefix, ties by load; power of two choices when load is imbalanced or no
    replica holds at least `min_match_fraction` of the prompt."""

    name = "prefix_affinity"

    def __init__(self, state: RouterState, rng: random.Random | None = None, *,
                 imbalance_abs: float = 8, imbalance_rel: float = 1.5,
                 min_match_fraction: float = 0.1) -> None:
        super().__init__(state, rng)
        self.imbalance_abs = imbalance_abs
        self.imbalance_rel = imbalance_rel
        self.min_match_fraction = min_match_fraction

    @classmethod
    def from_config(cls, state: RouterState, rng: random.Random | None, config: Any) -> "Policy":
        return cls(state, rng, imbalance_abs=config.imbalance_abs, imbalance_rel=config.imbalance_rel)

    def choose(self, request: RequestView, replicas: Sequence[ReplicaState], now: float) -> Decision:
        candidates = _check(replicas)
        if is_imbalanced(candidates, self.imbalance_abs, self.imbalance_rel):
            chosen = pow2_choice(candidates, self.rng)
            return Decision(chosen.replica_id, "imbalance_pow2", chosen.hit_pages(request.page_hashes, now))
        hits = {r.replica_id: r.hit_pages(request.page_hashes, now) for r in candidates}
        best = max(hits.values())
        if request.page_hashes and best >= self.min_match_fraction * len(request.page_hashes) and best > 0:
            chosen = min((r for r in candidates if hits[r.replica_id] == best), key=_load_key)
            return Decision(chosen.replica_id, "prefix_hit", best)
        chosen = min(candidates, key=_load_key)
        return Decision(chosen.replica_id, "least_load", hits[chosen.replica_id])
