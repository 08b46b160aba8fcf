"""The router's logic without Ray: request view from the call's argument, stats refresh, ranking,
bookkeeping. `serve_router.MSARequestRouter` is a thin adapter from Serve's hooks to this class.

The request is read from the deployment call's first positional argument (or keyword `request`):
- a `GenerateRequest` (prompt_token_ids, media, session_id, sampling.max_tokens), or
- a mapping with `prompt_token_ids` (list of ints) and optionally `media`, `session_id`, `max_tokens`.
The prompt is hashed with `kvcache.page_hash.prompt_page_hashes`, the replicas' own function, media
content hashes included (placeholder ids learned from the replicas' payloads).
Anything else (another method, a request without token ids) is routed on load alone with an
empty prefix: the policy still works, it just predicts no cache hits.
"""

import math
import random
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from msaserve.kvcache.page_hash import ROOT_HASH, hash_page, prompt_page_hashes
from msaserve.router.kv_aware import KVAwareConfig, make_policy
from msaserve.router.policies import Decision
from msaserve.router.state import RequestView, RouterState
from msaserve.router.stats import parse_routing_stats

DEFAULT_MAX_TOKENS = 256
ROUTING_TARGET = "routing_target"
"""A call whose first argument is a mapping with this key goes to the replica it names (a
router's snapshot request, `MSARequestRouter._fetch_snapshot`), or anywhere if that one is gone."""


CANDIDATE_PAGE_SIZES = (16, 32, 64, 128, 256)
"""Page sizes the router tries when no payload has told it the engine's (see RouterCore)."""


def read_prompt(args: Sequence[Any], kwargs: Mapping[str, Any],
                default_max_tokens: int = DEFAULT_MAX_TOKENS) -> tuple[Sequence[int] | None, str | None, int]:
    """(prompt token ids or None, session id or None, max tokens) of a call."""
    arg = args[0] if args else kwargs.get("request")
    if isinstance(arg, Mapping):
        token_ids, session_id = arg.get("prompt_token_ids"), arg.get("session_id")
        max_tokens = arg.get("max_tokens", default_max_tokens)
    else:
        token_ids, session_id = getattr(arg, "prompt_token_ids", None), getattr(arg, "session_id", None)
        max_tokens = getattr(getattr(arg, "sampling", None), "max_tokens", default_max_tokens)
    if not isinstance(token_ids, Sequence) or isinstance(token_ids, str | bytes):
        token_ids = None
    return token_ids, session_id if isinstance(session_id, str) else None, int(max_tokens or 0)


def cache_salt(args: Sequence[Any], kwargs: Mapping[str, Any]) -> int:
    """The call's page-hash chain root (`GenerateRequest.cache_salt`, the tenant's): the replica
    hashes its pages from it, so the router must too for prefix matches to mean anything."""
    arg = args[0] if args else kwargs.get("request")
    salt = arg.get("cache_salt") if isinstance(arg, Mapping) else getattr(arg, "cache_salt", None)
    return salt if isinstance(salt, int) else ROOT_HASH


def read_media(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Sequence[Any]:
    arg = args[0] if args else kwargs.get("request")
    media = arg.get("media") if isinstance(arg, Mapping) else getattr(arg, "media", None)
    return media if isinstance(media, Sequence) and not isinstance(media, str | bytes) else ()


def request_view(args: Sequence[Any], kwargs: Mapping[str, Any], page_size: int, request_id: str,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS,
                 media_token_ids: tuple[int, int] | None = None) -> RequestView:
    """What the router sees of a call (see the module docstring for the accepted shapes). A media
    prompt whose placeholder ids are not known yet (or do not match its media) predicts no hits."""
    token_ids, session_id, max_tokens = read_prompt(args, kwargs, default_max_tokens)
    if token_ids is None:
        return RequestView(request_id, (), 1, session_id)
    media = read_media(args, kwargs)
    try:
        hashes = prompt_page_hashes(token_ids, page_size, media, media_token_ids,
                                    parent=cache_salt(args, kwargs))
    except ValueError:  # the replica will answer 400; route it on load alone
        hashes = []
    num_tokens = len(token_ids) + sum(int(getattr(m, "num_placeholder_tokens", 1)) - 1 for m in media)
    num_pages = max(1, math.ceil((num_tokens + max_tokens) / page_size))
    return RequestView(request_id, hashes, num_pages, session_id)


@dataclass
class DecisionLog:
    """Counts the router keeps; `serve_router.RayMetrics` also exports them through Ray."""

    decisions: Counter = field(default_factory=Counter)
    predicted_hit_pages: int = 0
    routed_prompt_pages: int = 0
    reported_hit_rate: dict[str, float] = field(default_factory=dict)
    load_imbalance: float = 1.0
    resyncs: int = 0

    def decision(self, policy: str, decision: Decision, prompt_pages: int) -> None:
        self.decisions[decision.reason] += 1
        self.predicted_hit_pages += decision.predicted_hit_pages
        self.routed_prompt_pages += prompt_pages

    def spilled(self, policy: str) -> None:
        """Serve sent the request to a lower-ranked replica (the first one's queue was full)."""
        self.decisions["spilled"] += 1

    def resync_requested(self, replica_id: str) -> None:
        self.resyncs += 1

    def replica_hit_rate(self, replica_id: str, hit_rate: float) -> None:
        self.reported_hit_rate[replica_id] = hit_rate

    def imbalance(self, value: float) -> None:
        self.load_imbalance = value


class RouterCore:
    """page_size: the engine's. None = learn it: from the `page_size` key of a routing-stats
    payload, else by matching reported page hashes against the first page of recently routed
    prompts hashed at each of CANDIDATE_PAGE_SIZES. Until then prompts are hashed at 128 tokens
    (predictions may miss; routing still balances load)."""

    def __init__(self, policy: str = "kv_aware", page_size: int | None = None, *,
                 log: DecisionLog | None = None,
                 kv_aware: KVAwareConfig | None = None, estimate_expiry_s: float = 30.0,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS, seed: int | None = None,
                 clock: Callable[[], float] = time.time,
                 resync: Callable[[str], None] | None = None) -> None:
        if page_size is not None and page_size < 1:
            raise ValueError(f"page_size={page_size} is invalid: allowed an integer ≥ 1")
        self.state = RouterState(estimate_expiry_s)
        self.policy = make_policy(policy, self.state, random.Random(seed), kv_aware=kv_aware)
        self.page_size = page_size
        self._configured_page_size = page_size is not None
        self._probes: deque[dict[int, int]] = deque(maxlen=64)
        self.default_max_tokens = default_max_tokens
        self.log = log or DecisionLog()
        self.clock = clock
        self._decided: OrderedDict[str, tuple[Decision, RequestView]] = OrderedDict()
        """internal request id -> (first decision, view): retries re-rank but are recorded once."""
        self.media_token_ids: tuple[int, int] | None = None
        self.resync = resync
        """Asks a replica for a snapshot (its answer comes back through `snapshot_arrived`)."""
        self.resyncing: set[str] = set()
        self.placements: deque[tuple[str, Decision, str]] = deque(maxlen=10_000)
        """(request key, the policy's decision, replica Serve sent it to), oldest first."""

    def refresh(self, replicas: Sequence[tuple[str, Mapping]]) -> None:
        """Fold in each replica's latest routing-stats payload: from `update_replicas` (every
        broadcast Serve makes) and from `choose_replicas`. Serve re-sends the same one until the
        next poll; a payload seen already is skipped before its hashes are decoded."""
        now = self.clock()
        for replica_id, payload in replicas:
            replica = self.state.replica(replica_id)
            seen = payload and payload.get("epoch") == replica.stats_epoch
            if seen and payload.get("seq", -1) <= replica.stats_seq and replica.synced:
                continue
            self.apply_payload(replica_id, payload, now)
        loads = [self.state.replicas[rid].load for rid, _ in replicas]
        if loads and sum(loads):
            self.log.imbalance(max(loads) / (sum(loads) / len(loads)))

    def apply_payload(self, replica_id: str, payload: Mapping, now: float | None = None) -> None:
        """One payload (or a resync snapshot) of one replica; asks for a snapshot when the
        replica's view cannot be brought up to date from the payloads' journal."""
        stats = parse_routing_stats(payload)
        if stats is None or (stats.replica_id is not None and stats.replica_id != replica_id):
            return  # nothing yet, or a snapshot answered by another replica (the target died)
        self._learn_page_size(stats.page_size, stats.stored_hint)
        if stats.media_token_ids is not None:
            self.media_token_ids = stats.media_token_ids
        if self.state.apply_stats(replica_id, stats, self.clock() if now is None else now):
            self.log.replica_hit_rate(replica_id, stats.prefix_hit_rate)
        replica = self.state.replicas[replica_id]
        if replica.needs_resync and self.resync is not None and replica_id not in self.resyncing:
            self.resyncing.add(replica_id)
            self.log.resync_requested(replica_id)
            self.resync(replica_id)

    def snapshot_arrived(self, replica_id: str, payload: Mapping | None) -> None:
        """The answer to `resync(replica_id)` (None: the call failed; the next gap asks again)."""
        self.resyncing.discard(replica_id)
        if payload and replica_id in self.state.replicas:
            self.apply_payload(replica_id, payload)

    def _learn_page_size(self, reported: int | None, stored: Sequence[int]) -> None:
        if self._configured_page_size:
            return
        if reported is not None:
            self.page_size = reported
        elif self.page_size is None and stored:
            held = set(stored)
            for probe in self._probes:
                match = next((size for h, size in probe.items() if h in held), None)
                if match is not None:
                    self.page_size = match
                    return

    def _probe(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        token_ids, _, _ = read_prompt(args, kwargs)
        if token_ids:
            root = cache_salt(args, kwargs)
            self._probes.append({hash_page(root, token_ids[:size]): size
                                 for size in CANDIDATE_PAGE_SIZES if len(token_ids) >= size})

    def rank(self, args: Sequence[Any], kwargs: Mapping[str, Any], request_key: str,
             replica_ids: Sequence[str], session_id: str | None = None) -> list[Decision]:
        """Candidates in preference order. `session_id`: the handle's `options(session_id=...)`,
        used when the argument carries none (so GET /v1/sessions/{id} reaches the session's home).
        The first decision for a generate call is recorded (state + metrics); a retry (all queues
        were full) only re-ranks; calls without prompt tokens (info, stats, session_info) are not
        counted as load."""
        now = self.clock()
        if self.page_size is None:
            self._probe(args, kwargs)
        page_size = self.page_size or 128
        decided = self._decided.get(request_key)
        if decided is not None:  # a retry: the prompt was hashed already
            view = decided[1]
        else:
            view = request_view(args, kwargs, page_size, request_key, self.default_max_tokens,
                                self.media_token_ids)
        if view.session_id is None and session_id:
            view = RequestView(view.request_id, view.page_hashes, view.num_pages, session_id)
        is_generate = read_prompt(args, kwargs)[0] is not None
        target = args[0].get(ROUTING_TARGET) if args and isinstance(args[0], Mapping) else None
        if target in replica_ids:
            return [Decision(target, "only_candidate")] + [
                Decision(rid, "least_load") for rid in replica_ids if rid != target]
        home = self.state.sessions.get(view.session_id) if view.session_id else None
        if not is_generate and home in replica_ids:
            # A session lookup (session_info, delete_session) is no work: it goes to the session's
            # home whatever its load, or it would not find the session.
            return [Decision(home, "session_affinity")] + [
                Decision(rid, "least_load") for rid in replica_ids if rid != home]
        ranking = self.policy.rank(view, [self.state.replica(rid) for rid in replica_ids], now)
        if is_generate and request_key not in self._decided:
            first = ranking[0]
            self._decided[request_key] = (first, view)
            if len(self._decided) > 1_000:  # Serve may not report where a request went: bound it
                self._decided.popitem(last=False)
            self.state.on_routed(view, first.replica_id, now)
            self.log.decision(self.policy.name, first, len(view.page_hashes))
        return ranking

    def routed(self, request_key: str, replica_id: str) -> None:
        """Where Serve actually sent the request (Serve's `on_request_routed`)."""
        decided = self._decided.pop(request_key, None)
        if decided is not None:
            self.placements.append((request_key, decided[0], replica_id))
        if decided is not None and decided[0].replica_id != replica_id:
            self.log.spilled(self.policy.name)
            self.state.reassign(decided[1], decided[0].replica_id, replica_id, self.clock())

    def sync(self, replica_ids: Sequence[str]) -> None:
        self.state.sync_replicas(replica_ids)

    def replica_died(self, replica_id: str) -> None:
        self.state.remove_replica(replica_id)
