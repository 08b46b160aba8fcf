"""The router's half of proactive session moves: which sessions leave which replica, and where to.

Sessions move before requests fail: off a replica that is **draining** (Helm drain, scale-down:
all of its sessions) or **overloaded** (more running and waiting sequences than `overload_factor`
times the mean of the live replicas: the excess, newest sessions first). Each goes to the live,
non-draining replica with the least load, counting the moves already planned. The replica side
(`engine/kv/moves.py`) persists each session to the KV cache service and the new home adopts it,
so a move costs an index load, not a prefill. Pure state, like `state.py`: no Ray, no engine.
"""

import dataclasses
from typing import Literal

from msaserve.router.state import RouterState

MoveReason = Literal["draining", "overloaded", "dead"]


@dataclasses.dataclass(frozen=True)
class PlannedMove:
    session_id: str
    from_replica: str
    to_replica: str
    reason: MoveReason


def plan_moves(state: RouterState, overload_factor: float = 1.5, min_load: int = 2) -> list[PlannedMove]:
    """Moves that empty draining replicas and bring overloaded ones down to the mean; updates the
    session → replica map. A replica counts as overloaded only above `min_load` sequences."""
    if overload_factor < 1.0:
        raise ValueError(f"overload_factor={overload_factor} is invalid: allowed ≥ 1.0")
    live = {rid: r for rid, r in state.replicas.items() if r.alive}
    targets = {rid: r.load for rid, r in live.items() if not r.draining}
    if not targets:
        return []
    mean = sum(targets.values()) / len(targets)
    homes: dict[str, list[str]] = {}
    for session_id, rid in state.sessions.items():  # insertion order: oldest sessions first
        homes.setdefault(rid, []).append(session_id)
    moves: list[PlannedMove] = []

    def move(session_id: str, source: str, reason: MoveReason) -> None:
        candidates = {rid: load for rid, load in targets.items() if rid != source}
        if not candidates:
            return
        target = min(candidates, key=lambda rid: (candidates[rid], rid))
        targets[target] += 1
        if source in targets:
            targets[source] -= 1
        state.sessions[session_id] = target
        moves.append(PlannedMove(session_id, source, target, reason))

    for rid, sessions in homes.items():
        replica = state.replicas.get(rid)
        if replica is None or not replica.alive:
            for session_id in sessions:
                move(session_id, rid, "dead")
        elif replica.draining:
            for session_id in sessions:
                move(session_id, rid, "draining")
        elif targets[rid] > max(min_load, overload_factor * mean):
            excess = targets[rid] - max(min_load, int(mean + 0.5))
            for session_id in reversed(sessions[-excess:]):  # newest first: the least invested here
                move(session_id, rid, "overloaded")
    return moves
