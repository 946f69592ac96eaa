"""One engine, one generation at a time: a worker thread and a bounded FIFO of waiting requests.

The Engine is synchronous and refuses a second concurrent stream, so every generation runs on this
one thread, in arrival order. Results go back through a `sink` callable (the app hands in one that
posts to its event loop). A request cancelled while waiting leaves the queue at once; one cancelled
while running stops at the end of its current cycle (`Engine.cancel`, and the worker closes the
stream when it sees the flag), and the engine is then ready for the next.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from edgespec.engine import Chunk, Engine
from edgespec.errors import ContextOverflowError, EdgespecError, EngineBusyError
from edgespec.server.isolation import Isolation
from edgespec.server.protocol import ApiError, GenRequest
from edgespec.stats import Stats

log = logging.getLogger("edgespec.server")

RETRY_AFTER_S = 1  # what a 503 tells the client to wait


@dataclass(frozen=True)
class Event:
    """What the worker reports for a job: a "chunk", then "done" (with the finish reason and stats),
    or an "error" (an ApiError) instead."""

    kind: str
    chunk: Chunk | None = None
    reason: str = ""
    stats: Stats | None = None
    error: ApiError | None = None


@dataclass(eq=False)
class Job:
    """One request in the worker's hands; `sink` hears its events (from the worker thread)."""

    request: GenRequest
    sink: Callable[[Event], None]
    client: Hashable = None  # who sent it (see edgespec.server.isolation)
    cancelled: threading.Event = field(default_factory=threading.Event)


class Worker:
    """Runs `engine`'s generations one at a time on its own thread.

    Args:
        engine: the loaded Engine (the worker owns it while running; it does not close it).
        max_waiting: most requests waiting behind the running one; beyond that `submit` raises a
            503 ApiError with Retry-After.
        isolation: what one client's requests may learn from another's (default: global, one
            client: every cache and the history shared).
    """

    def __init__(self, engine: Engine, max_waiting: int = 8, isolation: Isolation | None = None) -> None:
        if max_waiting < 0:
            raise EdgespecError(f"the queue size must be >= 0 (got {max_waiting})")
        self.engine = engine
        self.isolation = isolation or Isolation(engine, "global")
        self.max_waiting = max_waiting
        self.n_done = 0  # generations finished (answered)
        self.n_cancelled = 0  # requests cancelled while waiting or running
        self._waiting: deque[Job] = deque()
        self._current: Job | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="edgespec-serve-worker", daemon=True)
        self._thread.start()

    def submit(self, request: GenRequest, sink: Callable[[Event], None], client: Hashable = None) -> Job:
        """Queue `client`'s generation; its events go to `sink`. Raises ApiError 503 when the queue is full."""
        with self._cond:
            if self._closed:
                raise ApiError(503, "the server is shutting down", kind="server_error")
            if len(self._waiting) + (self._current is not None) > self.max_waiting:
                raise ApiError(503, f"the server is busy ({self.max_waiting} requests already waiting); "
                                    f"retry in {RETRY_AFTER_S} s", kind="server_error", code="server_busy",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
            job = Job(request, sink, client)
            self._waiting.append(job)
            self._cond.notify_all()
            return job

    def cancel(self, job: Job) -> None:
        """Drop `job` (its client went away): out of the queue if waiting, stopped within one cycle if
        running, nothing if finished. Thread-safe."""
        with self._cond:
            if job.cancelled.is_set():
                return
            job.cancelled.set()
            if job in self._waiting:
                self._waiting.remove(job)
                self.n_cancelled += 1
            elif self._current is job:
                self.engine.cancel()  # honoured at the top of the engine's next cycle

    def clear_history(self, client: Hashable) -> None:
        """Forget what `client`'s requests left behind: at once when idle, else around the running one."""
        self.isolation.request_clear(client)
        with self._cond:
            if self._current is None:  # and none starts while the lock is held
                self.isolation.apply_pending()

    def status(self) -> dict[str, Any]:
        """{"generating": bool, "waiting": n, "done": n, "cancelled": n, "history": mode, ...}."""
        with self._cond:
            return {"generating": self._current is not None, "waiting": len(self._waiting),
                    "done": self.n_done, "cancelled": self.n_cancelled, **self.isolation.status()}

    def close(self, timeout: float = 30.0) -> None:
        """Stop taking requests, stop the running one, fail the waiting ones, end the thread."""
        with self._cond:
            self._closed = True
            waiting, self._waiting = list(self._waiting), deque()
            if self._current is not None:
                self._current.cancelled.set()
                self.engine.cancel()
            self._cond.notify_all()
        for job in waiting:
            _send(job, Event("error", error=ApiError(503, "the server is shutting down", kind="server_error")))
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.isolation.leave()

    # -- the thread ------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._waiting or self._closed)
                if not self._waiting:
                    return
                job = self._current = self._waiting.popleft()
            try:
                self._run(job)
            finally:
                self.isolation.apply_pending()
                with self._cond:
                    self._current = None
                    self._cond.notify_all()

    def _run(self, job: Job) -> None:
        req, engine = job.request, self.engine
        reason = "length"
        try:
            self.isolation.enter(job.client)
            chunks = (engine.stream_chat(req.messages or [], **req.options) if req.kind == "chat"
                      else engine.stream(req.prompt or "", **req.options))
            with contextlib.closing(chunks):  # closing a stream early leaves the engine consistent
                for c in chunks:
                    if job.cancelled.is_set() or not _send(job, Event("chunk", chunk=c)):
                        break
                    reason = c.finish_reason or reason
        except ContextOverflowError as e:
            param = "messages" if req.kind == "chat" else "prompt"
            _send(job, Event("error", error=ApiError(400, str(e), param=param, code="context_length_exceeded")))
            return
        except EngineBusyError as e:  # the engine is shared with another caller: try again
            _send(job, Event("error", error=ApiError(503, str(e), kind="server_error",
                                                     headers={"Retry-After": str(RETRY_AFTER_S)})))
            return
        except EdgespecError as e:  # e.g. a chat template that fails on these messages
            _send(job, Event("error", error=ApiError(400, str(e))))
            return
        except Exception as e:  # a backend fault: one line in the log, a 500 to this client, next request runs
            log.error("generation failed: %s: %s", type(e).__name__, e)
            _send(job, Event("error", error=ApiError(500, f"generation failed: {type(e).__name__}",
                                                     kind="server_error")))
            return
        with self._cond:
            if job.cancelled.is_set():
                self.n_cancelled += 1
                return
            self.n_done += 1
        _send(job, Event("done", reason=reason, stats=engine.last_stats))


def _send(job: Job, event: Event) -> bool:
    """Hand `event` to the job's sink; False (and the job cancelled) if the sink is gone."""
    try:
        job.sink(event)
        return True
    except RuntimeError:  # the event loop that waited for it has closed
        job.cancelled.set()
        return False
