"""What the router knows about each replica: cached page hashes, load, sessions.

Pure state, no Ray and no engine objects, so that the live router (`serve_router.py`) and the
trace simulator (`benchmarks/router/simulate.py`) run the same policies over the same object.

Two sources feed a replica's view:
- reported: the replica's routing-stats payloads (`stats.py`) — page hashes from its KV events,
  running/waiting sequences, free pages. Authoritative but up to one stats period old.
- estimated: requests this router sent since the last report. Their page hashes are inserted
  optimistically with an expiry (the replica will prefill them, so the next request sharing the
  prefix should follow them), and their sequences and pages count as load until the next report.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from msaserve.router.stats import RoutingStats, hash_digest


@dataclass(frozen=True)
class RequestView:
    """The part of a request the router looks at."""

    request_id: str
    page_hashes: Sequence[int]
    """Chained hashes of the prompt's full pages (`kvcache.page_hash.page_hashes`), in order."""
    num_pages: int
    """Pages the request will occupy (prompt incl. a partial last page, plus expected output)."""
    session_id: str | None = None


@dataclass
class _Routed:
    """A request routed here since the replica's last report: counted as load until then."""

    time: float
    pages: int
    miss_pages: int
    request_id: str = ""


@dataclass
class ReplicaState:
    replica_id: str
    cached: set[int] = field(default_factory=set)
    """Page hashes the replica reported holding (from its KV events)."""
    estimated: dict[int, float] = field(default_factory=dict)
    """Page hashes of requests routed here, not yet confirmed by a report: hash -> expiry time."""
    num_running: int = 0
    num_waiting: int = 0
    num_free_pages: int = 0
    num_total_pages: int = 0
    waiting_prefill_pages: int | None = None
    """Pages the waiting queue still has to prefill, when the replica reports it."""
    draining: bool = False
    alive: bool = True
    resident_sessions: set[str] = field(default_factory=set)
    """Sessions whose MSA index is resident here (filled from the KV cache service when it exists)."""
    stats_epoch: str | None = None
    stats_seq: int = -1
    synced: bool = False
    """False after a gap the journal could not cover or a checksum mismatch, until a snapshot."""
    deltas_applied: int = 0
    snapshots_applied: int = 0
    gaps: int = 0
    mismatches: int = 0
    routed: list[_Routed] = field(default_factory=list)

    # ---- prefix view -------------------------------------------------------------------------
    def holds(self, page_hash: int, now: float) -> bool:
        if page_hash in self.cached:
            return True
        expiry = self.estimated.get(page_hash)
        return expiry is not None and expiry > now

    def hit_pages(self, page_hashes: Sequence[int], now: float) -> int:
        """Leading pages of the prompt held here. Hashes are chained, so the first miss ends the
        prefix: a later page with the same hash cannot exist without its parents."""
        n = 0
        for h in page_hashes:
            if not self.holds(h, now):
                break
            n += 1
        return n

    # ---- load --------------------------------------------------------------------------------
    @property
    def load(self) -> int:
        """Sequences running or waiting, including those routed since the last report."""
        return self.num_running + self.num_waiting + len(self.routed)

    @property
    def active_pages(self) -> int:
        """Pages in use (not free) plus pages of requests routed since the last report. The engine
        counts evictable prefix-cache pages as free, so these are pages of live sequences."""
        used = max(0, self.num_total_pages - self.num_free_pages)
        return used + sum(r.pages for r in self.routed)

    @property
    def free_pages(self) -> int:
        return max(0, self.num_free_pages - sum(r.pages for r in self.routed))

    def queued_prefill_pages(self, mean_miss_pages: float) -> float:
        """Prefill work ahead of a new request: reported, else waiting × the mean miss size; plus
        what was routed here since the report."""
        if self.waiting_prefill_pages is not None:
            reported = float(self.waiting_prefill_pages)
        else:
            reported = self.num_waiting * mean_miss_pages
        return reported + sum(r.miss_pages for r in self.routed)

    # ---- updates -----------------------------------------------------------------------------
    def on_routed(self, request: RequestView, miss_pages: int, now: float, expiry_s: float) -> None:
        until = now + expiry_s
        for h in request.page_hashes:
            if h not in self.cached:
                self.estimated[h] = max(until, self.estimated.get(h, 0.0))
        self.routed.append(_Routed(now, request.num_pages, miss_pages, request.request_id))

    def apply_stats(self, stats: RoutingStats, now: float) -> bool:
        """Fold one payload in; False if it was seen already. Deltas the router has not applied
        are replayed in order; a gap the journal cannot cover, or a hash set that disagrees with
        the replica's checksum, leaves the view unsynced until a snapshot replaces it (the router
        then asks the replica for one: `needs_resync`)."""
        same_epoch = stats.epoch == self.stats_epoch
        if same_epoch and stats.seq <= self.stats_seq and (self.synced or not stats.full):
            return False  # the same payload seen again (Serve re-broadcasts unchanged replica info)
        self._apply_hashes(stats, same_epoch)
        self.stats_epoch, self.stats_seq = stats.epoch, stats.seq
        checksum = (stats.held_count, stats.held_digest)
        if self.synced and (len(self.cached), hash_digest(self.cached)) != checksum:
            self.synced = False
            self.mismatches += 1
        self.num_running, self.num_waiting = stats.num_running, stats.num_waiting
        self.num_free_pages, self.num_total_pages = stats.num_free_pages, stats.num_total_pages
        self.waiting_prefill_pages = stats.waiting_prefill_pages
        self.draining = stats.draining
        if stats.resident_sessions is not None:
            self.resident_sessions = set(stats.resident_sessions)
        # The report covers what was routed before it was taken (clocks of one cluster agree to
        # well under a stats period; `min` keeps a replica clock ahead of ours harmless).
        taken = min(now, stats.timestamp)
        self.routed = [r for r in self.routed if r.time > taken]
        self.estimated = {h: t for h, t in self.estimated.items() if t > now and h not in self.cached}
        return True

    def _apply_hashes(self, stats: RoutingStats, same_epoch: bool) -> None:
        replayable = same_epoch and bool(stats.deltas) and stats.deltas[0].seq <= self.stats_seq + 1
        if replayable and not (stats.full and not self.synced):
            for delta in stats.deltas:
                if delta.seq > self.stats_seq:
                    self.cached.update(delta.stored)
                    self.cached.difference_update(delta.removed)
                    self.deltas_applied += 1
        elif stats.snapshot is not None:
            self.cached = set(stats.snapshot)
            self.synced = True
            self.snapshots_applied += 1
        else:  # missed more payloads than the journal holds: approximate until a snapshot
            for delta in stats.deltas:
                self.cached.update(delta.stored)
                self.cached.difference_update(delta.removed)
            self.synced = False
            self.gaps += 1

    @property
    def needs_resync(self) -> bool:
        return self.stats_epoch is not None and not self.synced


def estimate_expiry_for(stats_period_s: float) -> float:
    """How long a routed request's pages count as held without a KV event confirming them: several
    stats periods (Serve's controller pulls payloads on its own loop, later than the period under
    load), and at least 10 s so that a slow prefill does not lose its followers."""
    return max(10.0, 4.0 * stats_period_s)


class RouterState:
    """All replicas plus the session -> replica map. One per router (per Serve handle)."""

    def __init__(self, estimate_expiry_s: float = 30.0) -> None:
        self.replicas: dict[str, ReplicaState] = {}
        self.sessions: dict[str, str] = {}
        self.estimate_expiry_s = estimate_expiry_s
        self._miss_pages_sum = 0.0
        self._miss_pages_count = 0

    def replica(self, replica_id: str) -> ReplicaState:
        state = self.replicas.get(replica_id)
        if state is None:
            state = self.replicas[replica_id] = ReplicaState(replica_id)
        return state

    def sync_replicas(self, replica_ids: Iterable[str]) -> None:
        """Keep exactly these replicas (Serve's current set); forget the others."""
        keep = set(replica_ids)
        for rid in keep:
            self.replica(rid)
        for rid in [r for r in self.replicas if r not in keep]:
            self.remove_replica(rid)

    def remove_replica(self, replica_id: str) -> None:
        """A dead replica: its pages are gone; its sessions get a new home on their next turn."""
        state = self.replicas.pop(replica_id, None)
        if state is not None:
            state.alive = False

    @property
    def mean_miss_pages(self) -> float:
        return self._miss_pages_sum / self._miss_pages_count if self._miss_pages_count else 0.0

    def on_routed(self, request: RequestView, replica_id: str, now: float) -> int:
        """Record a decision; returns the predicted prefix-hit pages on that replica."""
        replica = self.replica(replica_id)
        hit = replica.hit_pages(request.page_hashes, now)
        miss = max(0, len(request.page_hashes) - hit)
        replica.on_routed(request, miss, now, self.estimate_expiry_s)
        self._miss_pages_sum += miss
        self._miss_pages_count += 1
        if request.session_id is not None:
            self.sessions[request.session_id] = replica_id
        return hit

    def reassign(self, request: RequestView, from_id: str, to_id: str, now: float) -> None:
        """Serve sent the request to `to_id`, not to the router's first choice (its queue was full
        or it did not answer the queue-length probe in time): move the load and the session."""
        source = self.replicas.get(from_id)
        if source is not None:
            source.routed = [r for r in source.routed if r.request_id != request.request_id]
        self.on_routed(request, to_id, now)

    def apply_stats(self, replica_id: str, stats: RoutingStats, now: float) -> bool:
        """False if the payload was seen already."""
        applied = self.replica(replica_id).apply_stats(stats, now)
        # Sessions another router placed: learn their home, never override our own decisions.
        for session_id in stats.sessions:
            self.sessions.setdefault(session_id, replica_id)
        return applied
