"""How fast a model replica's queue drains, for the Retry-After of a 429 `queue_full`.

A fixed Retry-After (it was always 1 s) tells clients to come back long before a 64-deep queue of
long generations has moved, so they retry into another 429. The replica counts the requests it
finishes over a sliding window; a refused client is told to wait the time the requests ahead of it
(the waiting queue, plus itself) take to drain at that rate.
"""

import time
from collections import deque
from collections.abc import Callable

NO_DATA_RETRY_AFTER_S = 5.0
"""Before any request finished in the window the rate is unknown: the warm-up hint's 5 s."""
MAX_RETRY_AFTER_S = 600.0


class DrainRate:
    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self._started = clock()
        self._finished: deque[float] = deque()

    def note_finished(self) -> None:
        self._finished.append(self.clock())
        self._trim()

    def rate(self) -> float | None:
        """Requests finished per second over the window (or since start, if that is shorter)."""
        self._trim()
        if not self._finished:
            return None
        span = min(self.window_s, self.clock() - self._started)
        return len(self._finished) / max(span, 1.0)

    def retry_after_s(self, waiting: int) -> float:
        """Seconds until `waiting` queued requests and one more have drained at the measured rate."""
        rate = self.rate()
        if rate is None:
            return NO_DATA_RETRY_AFTER_S
        return min(MAX_RETRY_AFTER_S, max(1.0, (waiting + 1) / rate))

    def _trim(self) -> None:
        horizon = self.clock() - self.window_s
        while self._finished and self._finished[0] < horizon:
            self._finished.popleft()
