"""The engine as the model deployment uses it: an async generator of outputs per request.

The `LLMEngine` runs in one background thread that owns it (model, pages, queues); the event loop
only posts commands (add, abort) and receives outputs, so it stays responsive while a step runs.
Cancelling a consumer (or `aclose()` on its generator) aborts the request; the thread frees its
pages before the next step.
"""

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from msaserve.engine.config import EngineConfig
from msaserve.engine.llm_engine import LLMEngine
from msaserve.engine.types import (
    EngineStats,
    GenerateOutput,
    GenerateRequest,
    InvalidParameter,
    KVEvent,
    QueueFull,
)

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    request: GenerateRequest


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future


class AsyncEngine:
    def __init__(self, config: EngineConfig, model: object | None = None, tokenizer: object | None = None,
                 engine: LLMEngine | None = None) -> None:
        self.config = config
        self.engine = engine or LLMEngine(config, model, tokenizer)
        self._commands: queue.SimpleQueue[_Add | _Abort | _Call | None] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, asyncio.Queue[GenerateOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._lock = threading.Lock()  # guards the snapshot below
        self._stats = self.engine.stats()
        self._events: list[KVEvent] = []
        self._num_waiting_commands = 0

    # ---- what the platform reads ------------------------------------------------------------
    @property
    def tokenizer(self) -> object | None:
        return self.engine.tokenizer

    @property
    def model(self) -> object:
        """The replica's model (read-only use: its config and whether it has a vision tower)."""
        return self.engine.model

    @property
    def has_sessions(self) -> bool:
        """Whether sessions persist to and adopt from the KV cache service."""
        return self.engine.sessions is not None

    def use_kv_service_for_sessions(self) -> bool:
        """Persist and adopt sessions through the KV cache service when preempted pages already
        go there (call before `start`). True if sessions now use it."""
        return self.engine.use_kv_service_for_sessions()

    def drain_session_latencies(self) -> list[tuple[str, float]]:
        """(kind, seconds) of the index loads and page fetches since the last call."""
        sessions = self.engine.sessions
        drained = []
        while sessions is not None and sessions.latencies:
            drained.append(sessions.latencies.popleft())
        return drained

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def page_size(self) -> int:
        return self.engine.page_size

    def stats(self) -> EngineStats:
        """Load as of the end of the last step."""
        with self._lock:
            return self._stats

    def drain_kv_events(self) -> list[KVEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="msaserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the loop; requests still in flight end with finish_reason "abort"."""
        if self._thread is None:
            return
        self._stopping = True
        self._commands.put(None)
        self._wakeup.set()
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        for request_id in list(self.engine.trackers):
            output = self.engine.abort(request_id)
            if output is not None:
                self._deliver(output)

    # ---- requests ---------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Stream a request's outputs. Raises InvalidParameter, ContextTooLong or QueueFull before
        the first output; the last output has finished=True."""
        await self.start()
        self.engine.validate(request)
        if request.request_id in self._streams:
            raise InvalidParameter("request_id", request.request_id, "an id not already in flight")
        waiting = self.stats().num_waiting + self._num_waiting_commands
        if waiting >= self.config.max_waiting:
            raise QueueFull(waiting, self.config.max_waiting)
        if request.arrival_time is None:  # TTFT counts the time in the command queue too
            request = dataclasses.replace(request, arrival_time=time.time())
        stream: asyncio.Queue[GenerateOutput | BaseException] = asyncio.Queue()
        self._streams[request.request_id] = stream
        self._num_waiting_commands += 1
        self._post(_Add(request))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:  # the consumer went away: free the request's pages now
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        self._post(_Abort(request_id))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread between two steps (the engine is not thread-safe)
        and return its result (or raise its exception)."""
        await self.start()
        future = asyncio.get_running_loop().create_future()
        self._post(_Call(fn, future))
        return await future

    def _post(self, command: _Add | _Abort | _Call) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # ---- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            self._apply_commands()
            if self._stopping:
                break
            if not self.engine.has_unfinished():
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as error:  # a fault in a step fails the requests in it, not the replica
                logger.exception("engine step failed")
                self._fail_all(error)
                continue
            self._publish()
            for output in outputs:
                self._deliver(output)

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                self._add(command.request)
            elif isinstance(command, _Abort):
                output = self.engine.abort(command.request_id)
                if output is not None:
                    self._deliver(output)
            elif isinstance(command, _Call):
                self._run_call(command)
        self._publish()

    def _add(self, request: GenerateRequest) -> None:
        self._call_in_loop(self._added)
        try:
            self.engine.add_request(request)
        except Exception as error:
            self._deliver_error(request.request_id, error)

    def _run_call(self, command: _Call) -> None:
        try:
            result, error = command.fn(self.engine), None
        except Exception as e:  # delivered to the caller
            result, error = None, e
        self._call_in_loop(_settle, command.future, result, error)

    def _added(self) -> None:
        self._num_waiting_commands -= 1

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self.engine.trackers):
            self.engine.abort(request_id)
            self._deliver_error(request_id, RuntimeError(f"engine step failed: {error}"))
        self._publish()

    def _publish(self) -> None:
        stats, events = self.engine.stats(), self.engine.drain_kv_events()
        with self._lock:
            self._stats = stats
            self._events.extend(events)

    def _deliver(self, output: GenerateOutput) -> None:
        self._call_in_loop(self._put, output.request_id, output)

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        self._call_in_loop(self._put, request_id, error)

    def _put(self, request_id: str, item: GenerateOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(item)

    def _call_in_loop(self, callback, *args) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            callback(*args)  # shutdown() runs on the loop's own thread
        else:
            loop.call_soon_threadsafe(callback, *args)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
