"""What one request may learn from another's: the drafters' indexes, the cached prompt, and what
the `-k auto` scheduler learns of acceptance.

`edgespec serve --history off|session|global` (default: `auto`):

- **global**: one history index for every request, the target's and drafter's caches reused across
  requests whoever sent them, and one scheduler (the engine's own, which also reads and adds to the
  pair's acceptance record on disk) learning from all (the fastest; right for one local user).
- **session**: everything a client's requests teach the engine is the client's own, a client being
  an API key (or the only client, without keys), subdivided by the request's OpenAI `user` field
  when the key's holder sends one: its own history index, its own schedulers (acceptance and the
  timings they learn, each scope starting from the shared cost profile: Pricing.use), no pair
  record read or written. When a request comes from another client than the one before, the
  target's and drafter's KV caches are dropped and the drafter reset (an n-gram index forgotten)
  first, so neither its drafts, nor its γ, nor its timing depend on another client's text.
  With one client this is the same as global (but for the pair record).
- **off**: nothing is remembered across requests: every request is a client of its own (the
  history drafter indexes the current request and the corpus file only, the caches are dropped and
  the schedulers start cold before each request).
- **auto**: session, except off when the server listens beyond loopback without an API key
  (then it cannot tell its clients apart).

`POST /v1/history/clear` forgets the caller's index and schedulers (under global: the shared index).
What stays shared in every mode: the corpus file (the operator's choice) and the cost profile and
drafter cost priors (measured before the first request, on tokens of their own: the machine, not
any client's text), which `docs/serve.md` discusses.
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
ALONE = ("request",)  # the scheduler scope under off: forgotten before each request


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
        text may be in them (session: another client's request came last; off: any request did),
        and point the history drafter and the scheduler at the client's scope."""
        self.apply_pending()
        if self.mode == "off" or (self.mode == "session" and client != self._client):
            self._drop_caches()
        self._client = client
        self._learn_apart(client)
        if self.history is not None:
            self.history.use(self.scope(client))

    def _learn_apart(self, client: Hashable) -> None:
        """Schedule `client`'s request from what the client's own requests taught (session), from
        nothing (off: a scope forgotten before each request), or from everything (global: the
        engine's own). An engine without a drafter has no scheduler."""
        if self.engine.drafter is None:
            return
        pricing = self.engine.pricing
        if self.mode == "session":
            pricing.use(self._learning(client))
        elif self.mode == "off":
            pricing.forget(ALONE)
            pricing.use(ALONE)
        else:
            pricing.use(None)

    def leave(self) -> None:
        """The server is done with the engine: its scheduler is the engine's own again."""
        if self.engine.drafter is not None:
            self.engine.pricing.use(None)

    @staticmethod
    def _learning(client: Hashable) -> Hashable:
        """The scheduler scope of a client under session (never None, the engine's own scope)."""
        return ("client", client)

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
            if self.mode == "session" and self.engine.drafter is not None:
                self.engine.pricing.forget(self._learning(scope))
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
