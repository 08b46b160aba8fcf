"""Ray Serve's own routers as simulator baselines, labelled as simulations of them.

- `ray_pow2`: Ray Serve's default `PowerOfTwoChoicesRequestRouter` (ray/serve/_private/request_router/
  pow_2_router.py): two random candidates, each probed for its queue length (the replica's ongoing
  requests, fresh: Serve asks the replica), the shorter queue that still accepts (below
  `max_ongoing_requests`) wins; when neither accepts, the request waits in the router and the
  procedure repeats (FIFO).
- `ray_prefix_affinity`: Ray Serve LLM's `PrefixCacheAffinityRouter` (ray/llm/_internal/serve/
  routing_policies/prefix_aware/prefix_aware_router.py). It imports without vLLM, but its tree
  lives in a Ray actor and it reads a text prompt, so the simulator runs its documented policy
  around Ray's own `PrefixTree` class: if the candidates' queue lengths differ by more than
  `imbalanced_threshold` (default inf: never), power of two choices; else the tenants holding the
  longest matching prefix of the prompt, or — when the match covers less than
  `match_rate_threshold` (0.1) of it — the tenants with the fewest characters in the tree; the
  shortest queue among them that accepts wins; the prompt is inserted for the chosen replica
  (what it does in `on_request_routed`). No eviction (its default). Prompts become text as one
  character per trace block (512 tokens): the match rate is then in blocks, not characters.

Both see live queue lengths through `queue_len(replica_id)`, which the simulator reads from its
replicas, and answer None when no probed replica accepts (the request waits in the router).
"""

import math
import random
from collections.abc import Callable, Sequence

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree

from msaserve.router.policies import Decision, Policy, usable
from msaserve.router.state import ReplicaState, RequestView, RouterState

QueueLen = Callable[[str], int]


def _accepting(ids: Sequence[str], queue_len: QueueLen, max_ongoing: int, rng: random.Random) -> str | None:
    """Serve's probe of a candidate group: the shortest queue below max_ongoing (ties at random)."""
    lengths = {rid: queue_len(rid) for rid in ids}
    open_ = [rid for rid in ids if lengths[rid] < max_ongoing]
    if not open_:
        return None
    best = min(lengths[rid] for rid in open_)
    return rng.choice([rid for rid in open_ if lengths[rid] == best])


class RayPow2Sim(Policy):
    name = "ray_pow2"

    def __init__(self, state: RouterState, rng: random.Random, queue_len: QueueLen, max_ongoing: int) -> None:
        super().__init__(state, rng)
        self.queue_len = queue_len
        self.max_ongoing = max_ongoing

    def choose(self, request: RequestView, replicas: Sequence[ReplicaState], now: float) -> Decision | None:
        ids = [r.replica_id for r in usable(replicas)]
        pair = self.rng.sample(ids, 2) if len(ids) > 1 else ids
        chosen = _accepting(pair, self.queue_len, self.max_ongoing, self.rng)
        return None if chosen is None else Decision(chosen, "pow2")


def block_text(page_hashes: Sequence[int]) -> str:
    """One character per block id (skipping the surrogate range, which str cannot hold alone)."""
    chars = []
    for h in page_hashes:
        code = 0x100 + h % 0x10_0000
        chars.append(chr(code + 0x800 if code >= 0xD800 else code))
    return "".join(chars)


class RayPrefixAffinitySim(Policy):
    name = "ray_prefix_affinity"

    def __init__(self, state: RouterState, rng: random.Random, queue_len: QueueLen, max_ongoing: int,
                 imbalanced_threshold: float = math.inf, match_rate_threshold: float = 0.1) -> None:
        super().__init__(state, rng)
        self.queue_len = queue_len
        self.max_ongoing = max_ongoing
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self.tree = PrefixTree()
        self._tenants: set[str] = set()

    def choose(self, request: RequestView, replicas: Sequence[ReplicaState], now: float) -> Decision | None:
        ids = [r.replica_id for r in usable(replicas)]
        new = [rid for rid in ids if rid not in self._tenants]
        if new:
            self.tree.add_tenants(new, now)
            self._tenants.update(new)
        group = self._prefix_group(request, ids)
        reason = "prefix_hit"
        if not group:
            group, reason = (self.rng.sample(ids, 2) if len(ids) > 1 else ids), "pow2"
        chosen = _accepting(group, self.queue_len, self.max_ongoing, self.rng)
        if chosen is None:
            return None
        text = block_text(request.page_hashes)
        if text:
            self.tree.insert(text, chosen, now)
        return Decision(chosen, reason)  # type: ignore[arg-type]

    def _prefix_group(self, request: RequestView, ids: list[str]) -> list[str]:
        text = block_text(request.page_hashes)
        if not text:
            return []
        lengths = [self.queue_len(rid) for rid in ids]
        if max(lengths) - min(lengths) > self.imbalanced_threshold:
            return []
        matched, tenants = self.tree.prefix_match(text, ids)
        if len(matched) / len(text) < self.match_rate_threshold:
            smallest = self.tree.get_smallest_tenants() or []
            return [rid for rid in smallest if rid in ids]
        return [rid for rid in (tenants or []) if rid in ids]
