"""What one request may learn from another's: the history drafter's index and the cached prompt.

`edgespec serve --history off|session|global` (default: `auto`):

- **global**: one history index for every request, and the target's and drafter's caches reused
  across requests whoever sent them (the fastest; right for one local user).
- **session**: one index per client, a client being an API key (or the only client, without keys),
  subdivided by the request's OpenAI `user` field when the key's holder sends one. When a request
  comes from another client than the one before, the target's and drafter's KV caches are dropped
  first, so neither its drafts nor its timing (a cached prompt prefix, a draft model's catch-up)
  depend on another client's text. With one client this is the same as global.
- **off**: nothing is remembered across requests (the history drafter indexes the current request
  and the corpus file only); caches are dropped between clients as in session.
- **auto**: session, except off when the server listens beyond loopback without an API key
  (then it cannot tell its clients apart).

`POST /v1/history/clear` forgets the caller's index (the shared one under global). What stays shared
in every mode: the corpus file (the operator's choice) and the scheduler's cost and acceptance
estimates (numbers about speed, no text), which `docs/serve.md` discusses.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable

from edgespec.drafters.chain import members
from edgespec.drafters.history import HistoryDrafter
from edgespec.engine import Engine
from edgespec.errors import EdgespecError

log = logging.getLogger("edgespec.server")

MODES = ("auto", "off", "session", "global")
SHARED = "*"  # the scope every request shares under global


def resolve_mode(mode: str, n_keys: int, loopback: bool) -> str:
    """`mode` with auto decided: session if the server can tell its clients apart (API keys) or
    serves this machine only; off otherwise."""
    if mode not in MODES:
        raise EdgespecError(f"--history is {mode!r}: expected one of {', '.join(MODES)}")
    if mode == "auto":
        return "session" if n_keys or loopback else "off"
    if mode == "global" and n_keys > 1:
        log.warning("--history global with %d API keys: every client drafts from every other's text, "
                    "and response timing can reveal it (use --history session)", n_keys)
    return mode


class Isolation:
    """Switches the engine between clients (on the worker thread, before each generation) and
    clears a client's history on request (from any thread: applied at once when the engine is idle,
    otherwise before the next generation starts and again when the running one ends).

    Args:
        engine: the served engine; its drafter, if a HistoryDrafter, gets one scope per client.
        mode: "off", "session" or "global" (resolved: see `resolve_mode`).
    """

    def __init__(self, engine: Engine, mode: str) -> None:
        if mode not in MODES[1:]:
            raise EdgespecError(f"isolation mode {mode!r}: expected off, session or global")
        self.engine, self.mode = engine, mode
        self.history = next((d for d in members(engine.drafter) if isinstance(d, HistoryDrafter)), None)
        if self.history is not None and mode == "off":
            self.history.remember = False
            self.history.clear()
        self._client: Hashable = None  # whose text the caches hold
        self._pending: set[Hashable] = set()
        self._lock = threading.Lock()

    def scope(self, client: Hashable) -> Hashable:
        """The history scope of `client`'s requests."""
        return SHARED if self.mode == "global" else client

    def enter(self, client: Hashable) -> None:
        """Before `client`'s generation: apply pending clears, drop the caches if another client's
        text is in them (session, off), and point the history drafter at the client's scope."""
        self.apply_pending()
        if self.mode != "global" and client != self._client:
            self._drop_caches()
        self._client = client
        if self.history is not None:
            self.history.use(self.scope(client))

    def request_clear(self, client: Hashable) -> None:
        """Forget `client`'s history (called from the HTTP side): see the class docstring for when."""
        with self._lock:
            self._pending.add(self.scope(client))

    def apply_pending(self) -> None:
        """Carry out the clears asked for (worker thread, or any thread while the engine is idle)."""
        with self._lock:
            pending, self._pending = self._pending, set()
        for scope in pending:
            if self.history is not None:
                self.history.forget(scope)
            if scope == self.scope(self._client):  # the caches hold that text too
                self._drop_caches()

    def _drop_caches(self) -> None:
        self.engine.reset()
        if self.engine.drafter is not None:
            self.engine.drafter.reset()

    def status(self) -> dict[str, object]:
        """For /health: the mode, and the history index's size when there is one."""
        out: dict[str, object] = {"history": self.mode}
        if self.history is not None:
            out["history_tokens"] = self.history.indexed
        return out
