"""What a model replica remembers about the sessions it served (for GET/DELETE /v1/sessions/{id}).

The pages themselves are the engine's (prefix cache, keyed by chained page hashes, so the next turn
of a conversation hits them); this table records who used them and when. Deleting a session drops
the record; its pages age out of the prefix cache like any unreferenced page.
"""

import time
from collections.abc import Callable

from msaserve.engine.types import RequestStats
from msaserve.platform.model_messages import SessionInfo


class SessionTable:
    def __init__(self, max_sessions: int = 100_000, clock: Callable[[], float] = time.time) -> None:
        self.max_sessions = max_sessions
        self.clock = clock
        self._sessions: dict[str, SessionInfo] = {}
        self._active: dict[str, int] = {}

    def begin(self, session_id: str | None, replica_id: str) -> None:
        if not session_id:
            return
        now = self.clock()
        info = self._sessions.pop(session_id, None) or SessionInfo(
            session_id=session_id, replica_id=replica_id, created_at=now, last_used_at=now, num_turns=0,
            num_prompt_tokens=0, num_cached_tokens=0, num_output_tokens=0, active=False,
        )  # fmt: skip
        info.last_used_at = now
        info.num_turns += 1
        self._sessions[session_id] = info  # re-inserted last: dict order is least recently used first
        self._active[session_id] = self._active.get(session_id, 0) + 1
        while len(self._sessions) > self.max_sessions:
            oldest = next(iter(self._sessions))
            if self._active.get(oldest):
                break
            del self._sessions[oldest]

    def end(self, session_id: str | None, stats: RequestStats | None) -> None:
        if not session_id or session_id not in self._active:
            return
        self._active[session_id] -= 1
        if not self._active[session_id]:
            del self._active[session_id]
        info = self._sessions.get(session_id)
        if info is not None and stats is not None:
            info.num_prompt_tokens = stats.num_prompt_tokens
            info.num_cached_tokens = stats.num_cached_tokens
            info.num_output_tokens += stats.num_output_tokens

    def get(self, session_id: str) -> SessionInfo | None:
        info = self._sessions.get(session_id)
        if info is not None:
            info.active = bool(self._active.get(session_id))
        return info

    def delete(self, session_id: str) -> bool:
        return self._sessions.pop(session_id, None) is not None
