"""The routing-stats payload: what a model replica tells the router, and its parser.

Ray Serve calls the model deployment's `record_routing_stats()` every
`request_routing_stats_period_s` and hands the returned dict to every router as
`RunningReplica.routing_stats` (through the controller's long poll, which keeps only the latest
one: a router can miss payloads). The deployment builds that dict here:

    recorder = RoutingStatsRecorder()                       # one per replica, in __init__
    ...                                                     # per request: recorder.note_session(sid)
    def record_routing_stats(self) -> dict:
        return routing_stats_payload(engine.stats(), engine.drain_kv_events(), recorder,
                                     draining=self._draining)
    def routing_snapshot(self) -> dict:                     # a router's resync request
        return recorder.snapshot_payload(engine.stats())

Page hashes travel as numbered deltas so that no KV event is lost: payload `seq` carries the net
hashes stored and removed since payload `seq - 1`, and each payload repeats the last `journal_len`
deltas (`deltas`), so a router that missed a few payloads replays the ones it missed, in order. A
full snapshot (`snapshot`) rides on the first payload, after a `cleared` event (deltas cannot
express a clear: the journal restarts) and every `full_every` payloads. Every payload also carries
the count and XOR of the hashes held after it (`held`, `digest`): the router checks its view
against them and, on a gap it cannot replay or a mismatch, asks the replica for a snapshot
(`routing_snapshot`, see `serve_router.MSARequestRouter`). Hash lists are base64 of little-endian
uint64 (11 characters per hash; Serve hashes `str(routing_stats)` on every update).

Payload keys (version 2): v, epoch, seq, t (replica wall clock, s), snapshot (base64 or None),
deltas ([seq, stored, removed] oldest first), held, digest, events (hash events so far), running,
waiting, free_pages, total_pages, cached_pages, prefix_hit_rate, draining, waiting_prefill_pages
(int or None), sessions (session ids first seen since the previous payload), resident_sessions (list
or None), page_size (int or None: the engine's, so that the router hashes prompts the same way),
media_token_ids ([image, video] placeholder ids or None: the router expands media placeholders like
the engine), replica (the replica id, or None).
"""

import base64
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from msaserve.engine.types import EngineStats, KVEvent

PAYLOAD_VERSION = 2


def encode_hashes(hashes: Iterable[int]) -> str:
    return base64.b64encode(np.fromiter(hashes, dtype="<u8").tobytes()).decode("ascii")


def decode_hashes(text: str) -> list[int]:
    return np.frombuffer(base64.b64decode(text), dtype="<u8").tolist()


def hash_digest(hashes: Iterable[int]) -> int:
    """XOR of the hashes: with the count, the checksum of a replica's hash set."""
    array = np.fromiter(hashes, dtype=np.uint64)
    return int(np.bitwise_xor.reduce(array)) if array.size else 0


@dataclass(frozen=True)
class Delta:
    """Net page-hash changes between payload `seq - 1` and payload `seq`."""

    seq: int
    stored: list[int]
    removed: list[int]


class RoutingStatsRecorder:
    """Lives in the model deployment: folds KV events into the replica's hash set and numbers the
    deltas. `held` and `digest` are as of the last payload (events are folded in only then)."""

    def __init__(self, full_every: int = 30, clock: Callable[[], float] = time.time,
                 page_size: int | None = None, journal_len: int = 8) -> None:
        if full_every < 1:
            raise ValueError(f"full_every={full_every} is invalid: allowed an integer ≥ 1")
        if journal_len < 1:
            raise ValueError(f"journal_len={journal_len} is invalid: allowed an integer ≥ 1")
        self.full_every = full_every
        self.clock = clock
        self.page_size = page_size
        """The engine's page size: the router hashes prompts with it (set it once the engine is up)."""
        self.media_token_ids: tuple[int, int] | None = None
        """The engine's (image, video) placeholder ids, for models with a vision tower."""
        self.replica_id: str | None = None
        self.epoch = uuid.uuid4().hex[:12]
        self.seq = -1
        self.held: set[int] = set()
        self.digest = 0
        self.num_events = 0
        """Page-hash events (stored + removed hashes) folded in since the replica started."""
        self.journal: deque[Delta] = deque(maxlen=journal_len)
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
            self.num_events += len(event.page_hashes)
            if event.kind == "cleared":
                self.held.clear()
                self.digest = 0
                self._stored.clear()
                self._removed.clear()
                self.journal.clear()  # a delta cannot say "cleared": routers resync from a snapshot
                self._force_full = True
            elif event.kind == "stored":
                for h in event.page_hashes:
                    if h not in self.held:
                        self.held.add(h)
                        self.digest ^= h
                    self._removed.discard(h)
                    self._stored.add(h)
            elif event.kind == "removed":
                for h in event.page_hashes:
                    if h in self.held:
                        self.held.discard(h)
                        self.digest ^= h
                    self._stored.discard(h)
                    self._removed.add(h)
            else:
                raise ValueError(f"KVEvent.kind={event.kind!r} is invalid: allowed stored, removed, cleared")

    def next_delta(self) -> tuple[bool, list[str]]:
        """Close the current delta as payload `seq`: (whether it carries a snapshot, new sessions)."""
        self.seq += 1
        full = self._force_full or self.seq % self.full_every == 0
        self.journal.append(Delta(self.seq, list(self._stored), list(self._removed)))
        sessions, self._new_sessions = self._new_sessions, []
        self._stored, self._removed, self._force_full = set(), set(), False
        return full, sessions

    def hash_fields(self, full: bool) -> dict:
        return {
            "epoch": self.epoch,
            "seq": self.seq,
            "t": self.clock(),
            "snapshot": encode_hashes(self.held) if full else None,
            "deltas": [[d.seq, encode_hashes(d.stored), encode_hashes(d.removed)] for d in self.journal],
            "held": len(self.held),
            "digest": self.digest,
            "events": self.num_events,
        }

    def snapshot_payload(self, engine_stats: EngineStats, **kw) -> dict:
        """A full payload at the current `seq` without closing a delta: a router's resync."""
        return _payload(engine_stats, self, self.hash_fields(full=True), [], **kw)


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
    full, sessions = recorder.next_delta()
    return _payload(engine_stats, recorder, recorder.hash_fields(full), sessions, draining=draining,
                    waiting_prefill_pages=waiting_prefill_pages, resident_sessions=resident_sessions,
                    page_size=page_size)


def _payload(engine_stats: EngineStats, recorder: RoutingStatsRecorder, hash_fields: dict,
             sessions: list[str], *, draining: bool = False, waiting_prefill_pages: int | None = None,
             resident_sessions: Iterable[str] | None = None, page_size: int | None = None) -> dict:
    return {
        "v": PAYLOAD_VERSION,
        **hash_fields,
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
        "media_token_ids": None if recorder.media_token_ids is None else list(recorder.media_token_ids),
        "replica": recorder.replica_id,
    }


@dataclass(frozen=True)
class RoutingStats:
    """A parsed payload (see the module docstring for the wire keys)."""

    epoch: str
    seq: int
    timestamp: float
    snapshot: list[int] | None
    deltas: tuple[Delta, ...]
    held_count: int
    held_digest: int
    num_events: int
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
    media_token_ids: tuple[int, int] | None = None
    replica_id: str | None = None

    @property
    def full(self) -> bool:
        return self.snapshot is not None

    @property
    def stored_hint(self) -> list[int]:
        """Hashes this payload shows the replica holding (to learn the page size from)."""
        return self.snapshot if self.snapshot is not None else [h for d in self.deltas for h in d.stored]


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
        media_ids = payload.get("media_token_ids")
        snapshot = payload["snapshot"]
        return RoutingStats(
            epoch=str(payload["epoch"]),
            seq=int(payload["seq"]),
            timestamp=float(payload["t"]),
            snapshot=None if snapshot is None else decode_hashes(snapshot),
            deltas=tuple(Delta(int(s), decode_hashes(a), decode_hashes(r)) for s, a, r in payload["deltas"]),
            held_count=int(payload["held"]),
            held_digest=int(payload["digest"]),
            num_events=int(payload["events"]),
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
            media_token_ids=None if media_ids is None else (int(media_ids[0]), int(media_ids[1])),
            replica_id=payload.get("replica"),
        )
    except KeyError as e:
        raise ValueError(f"routing_stats is missing key {e.args[0]!r} (payload version 2)") from None
