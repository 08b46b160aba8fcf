"""The routing-stats payload: what a model replica tells the router, and its parser.

Ray Serve calls the model deployment's `record_routing_stats()` every
`request_routing_stats_period_s` and hands the returned dict to every router as
`RunningReplica.routing_stats`. The deployment builds that dict here:

    recorder = RoutingStatsRecorder()                       # one per replica, in __init__
    ...                                                     # per request: recorder.note_session(sid)
    def record_routing_stats(self) -> dict:
        return routing_stats_payload(engine.stats(), engine.drain_kv_events(), recorder,
                                     draining=self._draining)

Page hashes are delta-encoded: a payload carries the hashes stored and removed since the previous
payload (net of each other), with `epoch` (one per replica process) and `seq` so that a router
notices a missed payload, and a full snapshot of every held hash on the first payload, after a
`cleared` event, every `full_every` payloads, and whenever the delta would be larger than the
snapshot. Hash lists travel as base64 of little-endian uint64 (11 characters per hash; Serve
hashes `str(routing_stats)` on every update, so a compact string is cheaper than a list of ints).

Payload keys (version 1): v, epoch, seq, t (replica wall clock, s), full, stored, removed
(base64 uint64), running, waiting, free_pages, total_pages, cached_pages, prefix_hit_rate,
draining, waiting_prefill_pages (int or None), sessions (session ids first seen since the
previous payload), resident_sessions (list or None: sessions whose MSA index is resident),
page_size (int or None: the engine's page size, so that the router hashes prompts the same way;
pass `page_size=engine.page_size` or set `recorder.page_size`).
"""

import base64
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from msaserve.engine.types import EngineStats, KVEvent

PAYLOAD_VERSION = 1


def encode_hashes(hashes: Iterable[int]) -> str:
    return base64.b64encode(np.fromiter(hashes, dtype="<u8").tobytes()).decode("ascii")


def decode_hashes(text: str) -> list[int]:
    return np.frombuffer(base64.b64decode(text), dtype="<u8").tolist()


class RoutingStatsRecorder:
    """Lives in the model deployment: folds KV events into the replica's hash set and emits deltas."""

    def __init__(self, full_every: int = 30, clock: Callable[[], float] = time.time,
                 page_size: int | None = None) -> None:
        if full_every < 1:
            raise ValueError(f"full_every={full_every} is invalid: allowed an integer ≥ 1")
        self.full_every = full_every
        self.clock = clock
        self.page_size = page_size
        """The engine's page size: the router hashes prompts with it (set it once the engine is up)."""
        self.epoch = uuid.uuid4().hex[:12]
        self.seq = -1
        self.held: set[int] = set()
        self._stored: set[int] = set()
        self._removed: set[int] = set()
        self._new_sessions: list[str] = []
        self._seen_sessions: set[str] = set()
        self._force_full = True

    def note_session(self, session_id: str | None) -> None:
        """Called per request: the router learns where sessions live even if another router
        (another gateway replica's handle) placed them."""
        if session_id and session_id not in self._seen_sessions:
            self._seen_sessions.add(session_id)
            self._new_sessions.append(session_id)

    def apply(self, events: Sequence[KVEvent]) -> None:
        for event in events:
            if event.kind == "cleared":
                self.held.clear()
                self._stored.clear()
                self._removed.clear()
                self._force_full = True
            elif event.kind == "stored":
                for h in event.page_hashes:
                    self.held.add(h)
                    self._removed.discard(h)
                    self._stored.add(h)
            elif event.kind == "removed":
                for h in event.page_hashes:
                    self.held.discard(h)
                    self._stored.discard(h)
                    self._removed.add(h)
            else:
                raise ValueError(f"KVEvent.kind={event.kind!r} is invalid: allowed stored, removed, cleared")

    def next_delta(self) -> tuple[int, bool, list[int], list[int], list[str]]:
        """(seq, full, stored, removed, new sessions) for the next payload; resets the delta."""
        self.seq += 1
        delta_size = len(self._stored) + len(self._removed)
        full = self._force_full or self.seq % self.full_every == 0 or delta_size > len(self.held)
        stored = list(self.held) if full else list(self._stored)
        removed = [] if full else list(self._removed)
        sessions, self._new_sessions = self._new_sessions, []
        self._stored, self._removed, self._force_full = set(), set(), False
        return self.seq, full, stored, removed, sessions


def routing_stats_payload(
    engine_stats: EngineStats,
    events: Sequence[KVEvent],
    recorder: RoutingStatsRecorder,
    *,
    draining: bool = False,
    waiting_prefill_pages: int | None = None,
    resident_sessions: Iterable[str] | None = None,
    page_size: int | None = None,
) -> dict:
    """The dict `record_routing_stats()` returns. `events`: KV events since the previous call."""
    recorder.apply(events)
    seq, full, stored, removed, sessions = recorder.next_delta()
    return {
        "v": PAYLOAD_VERSION,
        "epoch": recorder.epoch,
        "seq": seq,
        "t": recorder.clock(),
        "full": full,
        "stored": encode_hashes(stored),
        "removed": encode_hashes(removed),
        "running": engine_stats.num_running,
        "waiting": engine_stats.num_waiting,
        "free_pages": engine_stats.num_free_pages,
        "total_pages": engine_stats.num_total_pages,
        "cached_pages": engine_stats.num_cached_pages,
        "prefix_hit_rate": engine_stats.prefix_hit_rate,
        "draining": draining,
        "waiting_prefill_pages": waiting_prefill_pages,
        "sessions": sessions,
        "resident_sessions": None if resident_sessions is None else sorted(resident_sessions),
        "page_size": page_size if page_size is not None else recorder.page_size,
    }


@dataclass(frozen=True)
class RoutingStats:
    """A parsed payload (see the module docstring for the wire keys)."""

    epoch: str
    seq: int
    timestamp: float
    full: bool
    stored: list[int]
    removed: list[int]
    num_running: int
    num_waiting: int
    num_free_pages: int
    num_total_pages: int
    num_cached_pages: int = 0
    prefix_hit_rate: float = 0.0
    draining: bool = False
    waiting_prefill_pages: int | None = None
    sessions: tuple[str, ...] = ()
    resident_sessions: tuple[str, ...] | None = None
    page_size: int | None = None


def parse_routing_stats(payload: Mapping) -> RoutingStats | None:
    """None for an empty dict (a replica that has not reported yet); ValueError naming the key
    for a malformed payload, so a version skew between deployment and router is loud."""
    if not payload:
        return None
    if payload.get("v") != PAYLOAD_VERSION:
        raise ValueError(f"routing_stats v={payload.get('v')!r} is invalid: allowed {PAYLOAD_VERSION}")
    try:
        resident = payload.get("resident_sessions")
        waiting_prefill = payload.get("waiting_prefill_pages")
        return RoutingStats(
            epoch=str(payload["epoch"]),
            seq=int(payload["seq"]),
            timestamp=float(payload["t"]),
            full=bool(payload["full"]),
            stored=decode_hashes(payload["stored"]),
            removed=decode_hashes(payload["removed"]),
            num_running=int(payload["running"]),
            num_waiting=int(payload["waiting"]),
            num_free_pages=int(payload["free_pages"]),
            num_total_pages=int(payload["total_pages"]),
            num_cached_pages=int(payload.get("cached_pages", 0)),
            prefix_hit_rate=float(payload.get("prefix_hit_rate", 0.0)),
            draining=bool(payload.get("draining", False)),
            waiting_prefill_pages=None if waiting_prefill is None else int(waiting_prefill),
            sessions=tuple(payload.get("sessions", ())),
            resident_sessions=None if resident is None else tuple(resident),
            page_size=None if payload.get("page_size") is None else int(payload["page_size"]),
        )
    except KeyError as e:
        raise ValueError(f"routing_stats is missing key {e.args[0]!r} (payload version 1)") from None
