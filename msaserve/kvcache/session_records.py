"""Session records: what a replica needs to adopt a conversation it has never seen.

A record names its pages by chained page hash (the index store and block store hold the bytes);
only *full* pages are stored, so an adopting replica recomputes at most `page_size - 1` tail
tokens. Records grow incrementally: `append` adds the tokens and pages produced since the last
call, writing only the new bytes.

On disk, one directory per session:
- `tokens.bin` (int64) and `pages.bin` (uint64): append-only;
- `meta.json`: rewritten atomically (temp + rename) *after* the appends, holding the committed
  lengths and xxh3 checksums of both files. A crash between the two leaves a longer file whose
  uncommitted tail is ignored (and truncated on the next append); a checksum mismatch on load
  drops the session and counts a corruption, never serving it.
"""

import json
import os
import shutil
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from msaserve.kvcache.keys import ModelIdentity


class SessionNotFound(KeyError):
    pass


@dataclass
class SessionRecord:
    session_id: str
    model: ModelIdentity
    token_ids: list[int] = field(default_factory=list)
    """Every token of the conversation so far (prompt and generated)."""
    page_hashes: list[int] = field(default_factory=list)
    """Chained hashes of the full pages whose index-K and K/V are in the service, in order."""
    sampling_state: dict[str, object] = field(default_factory=dict)
    """JSON-able: sampling params, tokens generated, RNG state: whatever the engine needs."""
    pinned: bool = False
    updated_at: float = 0.0
    tail_hash: int | None = None
    """Key (a page hash, unique per write) of the partial last page's index-K and K/V, if stored."""
    tail_tokens: int = 0
    """Tokens of the partial last page held by the tail payload (the rest are recomputed)."""
    tokens_omitted: bool = False
    """True on a record fetched without its token ids (`KVCacheClient.get_session_head`):
    token_ids is then empty, and `get_session_tokens_async` fetches them. Never stored."""

    @property
    def num_stored_tokens(self) -> int:
        """Tokens whose K/V the service holds: full pages plus the stored tail."""
        tail = self.tail_tokens if self.tail_hash is not None else 0
        return len(self.page_hashes) * self.page_size + tail

    @property
    def page_size(self) -> int:
        return self.model.page_size

    def as_dict(self) -> dict[str, object]:
        return {
            "session_id": self.session_id, "model": self.model.as_dict(), "token_ids": list(self.token_ids),
            "page_hashes": list(self.page_hashes), "sampling_state": self.sampling_state,
            "pinned": self.pinned, "updated_at": self.updated_at, "tail_hash": self.tail_hash,
            "tail_tokens": self.tail_tokens,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "SessionRecord":
        return cls(
            session_id=data["session_id"], model=ModelIdentity.from_dict(data["model"]),
            token_ids=list(data["token_ids"]), page_hashes=[int(h) for h in data["page_hashes"]],
            sampling_state=dict(data.get("sampling_state", {})), pinned=bool(data.get("pinned", False)),
            updated_at=float(data.get("updated_at", 0.0)), tail_hash=data.get("tail_hash"),
            tail_tokens=int(data.get("tail_tokens", 0)),
        )


class SessionStore:
    """Records by session id, in memory, persisted under `path` when given.

    At most `max_sessions` records: a new one past the limit evicts the least recently updated
    unpinned record (its files too); pinned records (live sessions) and the record being written
    are never evicted, so only they can exceed the limit."""

    def __init__(
        self, path: str | os.PathLike[str] | None = None, fsync: bool = False, max_sessions: int | None = None
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.fsync = fsync
        self.max_sessions = max_sessions
        self.corruptions = 0
        self.evictions = 0
        self._records: OrderedDict[str, SessionRecord] = OrderedDict()  # least recently updated first
        self._token_arrays: dict[str, _TokenArray] = {}
        if self.path is not None:
            self.path.mkdir(parents=True, exist_ok=True)
            self._load_all()

    def __len__(self) -> int:
        return len(self._records)

    def get(self, session_id: str) -> SessionRecord:
        record = self._records.get(session_id)
        if record is None:
            raise SessionNotFound(f"session {session_id!r} is not in the KV cache service")
        return record

    def tokens(self, session_id: str) -> np.ndarray:
        """The session's token ids as an int64 array (read-only view; one buffer to send instead
        of a list of Python ints, which pickles and unpickles at ~10 M ints/s)."""
        return self._token_array(self.get(session_id)).view()

    def _token_array(self, record: SessionRecord) -> "_TokenArray":
        array = self._token_arrays.get(record.session_id)
        if array is None or len(array) != len(record.token_ids):  # a caller's record object grew
            array = self._token_arrays[record.session_id] = _TokenArray(record.token_ids)
        return array

    def session_ids(self) -> list[str]:
        return sorted(self._records)

    def put(self, record: SessionRecord) -> None:
        """Create or replace a session (replacing rewrites its files)."""
        if record.tokens_omitted:
            raise ValueError(f"session {record.session_id!r}: a record fetched without its token ids "
                             "(tokens_omitted=True) cannot be stored; fetch the whole record")
        record.updated_at = time.time()
        self._token_arrays[record.session_id] = _TokenArray(record.token_ids)
        self._records[record.session_id] = record
        self._records.move_to_end(record.session_id)
        self._evict_beyond_limit(keep=record.session_id)
        if self.path is not None:
            directory = self._dir(record.session_id)
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True)
            for name in ("tokens.bin", "pages.bin"):
                (directory / name).touch()
            self._write(record, 0, 0)

    def append(
        self,
        session_id: str,
        token_ids: list[int],
        page_hashes: list[int],
        sampling_state: dict[str, object] | None = None,
        tail: tuple[int | None, int] | None = None,
    ) -> SessionRecord:
        """Add new tokens and newly filled pages; only these bytes are written.
        tail: (tail_hash, tail_tokens) replaces the stored partial last page, if given."""
        record = self.get(session_id)
        old_tokens, old_pages = len(record.token_ids), len(record.page_hashes)
        array = self._token_array(record)
        record.token_ids.extend(int(t) for t in token_ids)
        array.extend(record.token_ids[old_tokens:])
        record.page_hashes.extend(int(h) for h in page_hashes)
        if sampling_state is not None:
            record.sampling_state = dict(sampling_state)
        if tail is not None:
            record.tail_hash, record.tail_tokens = tail
        record.updated_at = time.time()
        self._records.move_to_end(session_id)
        if self.path is not None:
            self._write(record, old_tokens, old_pages)
        return record

    def set_pinned(self, session_id: str, pinned: bool) -> SessionRecord:
        record = self.get(session_id)
        record.pinned = pinned
        if self.path is not None:
            self._write_meta(record)
        return record

    def unpin_idle(self, older_than: float, model_key: str) -> list[SessionRecord]:
        """Unpin this model's pinned records not updated since `older_than` (a time.time() value);
        returns them (their page pins are the caller's to release). Records stay, now evictable."""
        idle = [r for r in self._records.values()
                if r.pinned and r.updated_at < older_than and r.model.key == model_key]
        for record in idle:
            record.pinned = False
            if self.path is not None:
                self._write_meta(record)
        return idle

    def delete(self, session_id: str) -> SessionRecord | None:
        record = self._records.pop(session_id, None)
        self._token_arrays.pop(session_id, None)
        if self.path is not None:
            shutil.rmtree(self._dir(session_id), ignore_errors=True)
        return record

    def _evict_beyond_limit(self, keep: str | None = None) -> None:
        if self.max_sessions is None:
            return
        excess = len(self._records) - self.max_sessions
        if excess <= 0:
            return
        victims = [sid for sid, r in self._records.items() if not r.pinned and sid != keep][:excess]
        for session_id in victims:
            self.delete(session_id)
            self.evictions += 1

    # ---- disk --------------------------------------------------------------------------------
    def _dir(self, session_id: str) -> Path:
        assert self.path is not None
        return self.path / xxhash.xxh3_128_hexdigest(session_id.encode())

    def _write(self, record: SessionRecord, old_tokens: int, old_pages: int) -> None:
        directory = self._dir(record.session_id)
        new_tokens = self.tokens(record.session_id)[old_tokens:]
        new_pages = np.asarray(record.page_hashes[old_pages:], np.uint64)
        _append_array(directory / "tokens.bin", old_tokens * 8, new_tokens)
        _append_array(directory / "pages.bin", old_pages * 8, new_pages)
        if self.fsync:
            for name in ("tokens.bin", "pages.bin"):
                with open(directory / name, "rb+") as f:
                    os.fsync(f.fileno())
        self._write_meta(record)

    def _write_meta(self, record: SessionRecord) -> None:
        directory = self._dir(record.session_id)
        tokens = self.tokens(record.session_id)
        pages = np.asarray(record.page_hashes, np.uint64).tobytes()
        meta = {
            "version": 1, "session_id": record.session_id, "model": record.model.as_dict(),
            "num_tokens": len(record.token_ids), "num_pages": len(record.page_hashes),
            "tokens_xxh3": xxhash.xxh3_64_intdigest(tokens), "pages_xxh3": xxhash.xxh3_64_intdigest(pages),
            "sampling_state": record.sampling_state, "pinned": record.pinned, "updated_at": record.updated_at,
            "tail_hash": record.tail_hash, "tail_tokens": record.tail_tokens,
        }
        tmp = directory / ".meta.json.tmp"
        with open(tmp, "w") as f:
            json.dump(meta, f)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, directory / "meta.json")

    def _load_all(self) -> None:
        assert self.path is not None
        for directory in sorted(self.path.iterdir()):
            if not (directory / "meta.json").is_file():
                continue
            record = _load_one(directory)
            if record is None:
                self.corruptions += 1
                shutil.rmtree(directory, ignore_errors=True)
            else:
                self._records[record.session_id] = record
        for record in sorted(self._records.values(), key=lambda r: r.updated_at):
            self._records.move_to_end(record.session_id)  # least recently updated first
        self._evict_beyond_limit()


def _append_array(file: Path, committed_bytes: int, values: np.ndarray) -> None:
    """Write values at committed_bytes, dropping any uncommitted tail a crash left behind."""
    with open(file, "rb+") as f:
        f.truncate(committed_bytes)
        f.seek(committed_bytes)
        f.write(values.tobytes())


def _load_one(directory: Path) -> SessionRecord | None:
    """The committed record, or None if its files do not match their checksums."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
        tokens = (directory / "tokens.bin").read_bytes()[: meta["num_tokens"] * 8]
        pages = (directory / "pages.bin").read_bytes()[: meta["num_pages"] * 8]
    except (OSError, ValueError, KeyError):
        return None
    if (
        len(tokens) != meta["num_tokens"] * 8 or len(pages) != meta["num_pages"] * 8
        or xxhash.xxh3_64_intdigest(tokens) != meta["tokens_xxh3"]
        or xxhash.xxh3_64_intdigest(pages) != meta["pages_xxh3"]
    ):
        return None
    return SessionRecord(
        session_id=meta["session_id"], model=ModelIdentity.from_dict(meta["model"]),
        token_ids=np.frombuffer(tokens, np.int64).tolist(),
        page_hashes=np.frombuffer(pages, np.uint64).tolist(),
        sampling_state=meta["sampling_state"], pinned=meta["pinned"], updated_at=meta["updated_at"],
        tail_hash=meta.get("tail_hash"), tail_tokens=meta.get("tail_tokens", 0),
    )


class _TokenArray:
    """A session's token ids as a growable int64 array, kept beside the record's list."""

    def __init__(self, token_ids: list[int] | np.ndarray) -> None:
        values = np.asarray(token_ids, dtype=np.int64)
        self._buffer = np.empty(max(16, len(values)), dtype=np.int64)
        self._buffer[: len(values)] = values
        self._size = len(values)

    def __len__(self) -> int:
        return self._size

    def extend(self, token_ids: list[int]) -> None:
        end = self._size + len(token_ids)
        if end > len(self._buffer):
            grown = np.empty(max(end, 2 * len(self._buffer)), dtype=np.int64)
            grown[: self._size] = self._buffer[: self._size]
            self._buffer = grown
        self._buffer[self._size : end] = token_ids
        self._size = end

    def view(self) -> np.ndarray:
        view = self._buffer[: self._size]
        view.flags.writeable = False
        return view
