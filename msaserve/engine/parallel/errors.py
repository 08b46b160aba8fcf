"""The error a multi-rank replica reports when it can no longer step (its own module: the driver's
runner raises it without importing Ray)."""

from msaserve.engine.types import EngineError


class ReplicaGroupFailed(EngineError):
    """A rank of this multi-rank replica died or timed out: the replica cannot step any more (503:
    the request may be retried on another replica, where its session resumes from the KV cache)."""

    status = 503

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
