"""Moving live sessions off a replica (drain, scale-down, overload), and what a failure can lose.

The replica's half of the move protocol (the router's half, which sessions go where, is
`router/moves.py`):
- `move_out` (the old home, asked to drain or shed load): each running or waiting request of a
  session is persisted up to its last token (`EngineSessions.make_current`), then stopped here;
  its `SessionMove` says how to continue it — all tokens so far, the tokens still to generate;
- `move_in` (the new home): the move becomes a request whose prompt is those tokens; the engine
  adopts the session from the KV cache service (index first, K/V as selected), so the
  continuation is the tokens the old home would have produced (greedy decoding).
- A replica that dies never gets to `move_out`: its sessions continue from the last sync
  (write-behind every `sync_every` steps, so the record lags the tokens by less than that;
  `persist_lag_tokens` reports it). The tokens the client already received extend the prompt;
  the adopter recomputes the ones the record lacks, and the session is not lost.
"""

import dataclasses

from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.sequence import SequenceStatus
from msaserve.engine.types import GenerateRequest, SamplingParams


@dataclasses.dataclass(frozen=True)
class SessionMove:
    """One session leaving a replica mid-turn."""

    session_id: str
    request_id: str
    token_ids: list[int]
    """Every token of the session so far (the turn's prompt and what it generated here)."""
    num_generated: int
    """Tokens of this turn generated on the old home (already streamed to the client)."""
    sampling: SamplingParams
    """The turn's sampling, max_tokens counting what is left to generate."""
    persisted_tokens: int
    """Tokens the service's record held when the old home let go (== len(token_ids) after a drain)."""


def move_out(engine: LLMEngine, session_ids: set[str] | None = None) -> list[SessionMove]:
    """Persist and stop the requests of these sessions (None: every session here) → their moves."""
    sessions = engine.sessions
    if sessions is None:
        raise ValueError("move_out needs the KV cache service: attach_kv_client first")
    moves = []
    for request_id, session_id in list(sessions.session_of.items()):
        if session_ids is not None and session_id not in session_ids:
            continue
        tracker = engine.trackers.get(request_id)
        if tracker is None:
            continue
        seq = tracker.seq
        if seq.status in (SequenceStatus.RUNNING, SequenceStatus.RESIDENT):
            sessions.make_current(seq)
        writer = sessions.writers.get(request_id)
        persisted = writer.num_tokens if writer is not None else 0
        left = seq.sampling.max_tokens - seq.num_output_tokens
        moves.append(SessionMove(
            session_id=session_id, request_id=request_id, token_ids=list(seq.token_ids),
            num_generated=seq.num_output_tokens, persisted_tokens=persisted,
            sampling=dataclasses.replace(seq.sampling, max_tokens=max(1, left)),
        ))
        engine.abort(request_id)
        sessions.release(session_id)
    return moves


def move_in(engine: LLMEngine, move: SessionMove, request_id: str | None = None) -> str:
    """Continue a moved session here (adopting it from the KV cache service) → its request id."""
    request_id = request_id or f"{move.request_id}/moved"
    engine.add_request(GenerateRequest(request_id, list(move.token_ids), move.sampling,
                                       session_id=move.session_id))
    return request_id


def persist_lag_tokens(engine: LLMEngine) -> int:
    """The most tokens any session request here generated that its service record does not yet
    hold: what a failure of this replica right now would make the adopter recompute from the
    tokens the client received (write-behind; the prompt the client holds anyway)."""
    sessions = engine.sessions
    if sessions is None:
        return 0
    lag = 0
    for request_id, writer in sessions.writers.items():
        tracker = engine.trackers.get(request_id)
        if tracker is not None:
            seq = tracker.seq
            lag = max(lag, len(seq.token_ids) - max(writer.num_tokens, seq.num_prompt_tokens))
    return lag
