"""What the process's other threads run while the main thread does timed work: a diagnostic for
host-side waits that no device profile shows (issue 30: the H200 adoption's host-tier reset took
7-29 ms for 0.1 ms of work, most likely waiting for the GIL).

`ThreadWatch` samples `sys._current_frames()` every `interval_s` from a thread of its own. A sample
runs only while that thread holds the GIL, so a thread seen in Python code (not parked in a wait,
a queue or a lock) was running or queued for the GIL then. At exit it counts, per thread name, the
innermost frames outside the standard library, and `report()` lists the most frequent ones. It
also records every garbage collection that ran meanwhile (generation, thread, milliseconds: a
collection holds the GIL throughout, whichever thread started it).
"""

import collections
import gc
import sys
import sysconfig
import threading
import time
from types import FrameType, TracebackType

_STDLIB = sysconfig.get_paths()["stdlib"]
_PARKED = {"wait", "_wait_for_tstate_lock", "get", "select", "poll", "acquire", "_worker", "sleep"}
"""Innermost function names of a thread that waits (it holds no GIL there)."""


def _where(frame: FrameType | None, depth: int = 3) -> str | None:
    """The innermost `depth` frames outside the standard library as 'file:line fn < …'; None for a
    thread parked in a wait (its innermost frame is one of `_PARKED` in the standard library)."""
    if frame is None:
        return None
    if frame.f_code.co_filename.startswith(_STDLIB) and frame.f_code.co_name in _PARKED:
        return None
    parts = []
    while frame is not None and len(parts) < depth:
        code = frame.f_code
        if not code.co_filename.startswith(_STDLIB):
            parts.append(f"{code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return " < ".join(parts) if parts else None


class ThreadWatch:
    """with ThreadWatch() as watch: ...  → watch.counts[(thread name, where)] samples, watch.samples."""

    def __init__(self, interval_s: float = 0.0005) -> None:
        self.interval_s = interval_s
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="thread-watch", daemon=True)
        self._main = threading.get_ident()
        self.collections: list[tuple[int, str, float]] = []
        """(generation, thread name, ms) of each garbage collection during the watch."""
        self._gc_started = 0.0

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:  # -1 ms: it began before the watch
            ms = 1e3 * (time.perf_counter() - self._gc_started) if self._gc_started else -1.0
            self.collections.append((info["generation"], threading.current_thread().name, ms))
            self._gc_started = 0.0

    def _run(self) -> None:
        names = {}
        while not self._stop.is_set():
            frames = sys._current_frames()
            if len(names) != len(frames):
                names = {t.ident: t.name for t in threading.enumerate()}
            self.samples += 1
            for ident, frame in frames.items():
                if ident in (self._main, self._thread.ident):
                    continue
                where = _where(frame)
                if where is not None:
                    self.counts[(names.get(ident, str(ident)), where)] += 1
            time.sleep(self.interval_s)

    def __enter__(self) -> "ThreadWatch":
        gc.callbacks.append(self._on_gc)
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        gc.callbacks.remove(self._on_gc)

    def report(self, top: int = 8) -> str:
        """The most frequent (thread, frames) of other threads in Python code, with their share of
        the samples."""
        collections_ = ", ".join(f"gen {g} in {name} {ms:.1f} ms" for g, name, ms in self.collections)
        gcs = f"; garbage collections: {collections_ or 'none'}"
        if not self.counts:
            return f"no other thread ran Python code in {self.samples} samples{gcs}"
        rows = [f"{count / max(1, self.samples):6.1%}  {name}: {where}"
                for (name, where), count in self.counts.most_common(top)]
        return f"{self.samples} samples{gcs}; other threads in Python code:\n  " + "\n  ".join(rows)
