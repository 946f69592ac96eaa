"""Running the app: `Server` (uvicorn, in the foreground or on a thread) and `serve()`.

uvicorn and starlette are the optional extra `serve`; they are imported here, on use, so that
`import edgespec` and `edgespec --help` work without them.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from edgespec.engine import Engine
from edgespec.errors import EdgespecError, MissingDependencyError
from edgespec.server.protocol import Defaults

log = logging.getLogger("edgespec.server")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
DEFAULT_QUEUE = 8


def host_warning(host: str) -> str | None:
    """The warning for a host other than loopback (None for 127.0.0.1, ::1, localhost)."""
    if host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass
    return (f"listening on {host}, not only on this machine: anyone who can reach it can use the model"
            " (set --api-key, or keep the default --host 127.0.0.1)")


def api_keys(api_key: str | Sequence[str] | None) -> tuple[str, ...]:
    """The accepted keys: none, one, or several (each a client of its own); empty or repeated ones refused."""
    keys = () if api_key is None else (api_key,) if isinstance(api_key, str) else tuple(api_key)
    if any(not k.strip() for k in keys):
        raise EdgespecError("--api-key is empty")
    if len(set(keys)) < len(keys):
        raise EdgespecError("--api-key is given twice with the same key")
    return keys


def import_uvicorn() -> Any:
    """The uvicorn module (starlette checked too); MissingDependencyError naming the extra if absent."""
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise MissingDependencyError("edgespec serve needs uvicorn and starlette: "
                                     "pip install 'edgespec[serve]'") from e
    return uvicorn


class Server:
    """An OpenAI-compatible HTTP server over one Engine.

    Args:
        engine: the loaded Engine (not closed by the server).
        host, port: where to listen (port 0: a free port, see `url` once started).
        api_key: if set, every endpoint but /health wants `Authorization: Bearer <api_key>`; several
            keys (a sequence) are several clients, each with its own history (see `history`).
        queue: most requests waiting behind the running generation (beyond: 503 + Retry-After).
        history: "auto", "off", "session" or "global": what a request may draft from (and its timing
            reveal) of earlier requests; edgespec.server.isolation says what each means.
        defaults: sampling values for requests that omit them.
        model: the model id /v1/models reports (default: the target file's name).
        access_log: log every request (uvicorn's access log).
    """

    def __init__(self, engine: Engine, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                 api_key: str | Sequence[str] | None = None, queue: int = DEFAULT_QUEUE,
                 history: str = "auto", defaults: Defaults | None = None, model: str | None = None,
                 access_log: bool = False) -> None:
        uvicorn = import_uvicorn()
        from edgespec.server.app import ServeState, create_app
        from edgespec.server.isolation import Isolation, resolve_mode
        from edgespec.server.worker import Worker

        if not 0 <= port <= 65535:
            raise EdgespecError(f"--port must be in 0..65535 (got {port})")
        keys = api_keys(api_key)
        self.engine = engine
        self.history = resolve_mode(history, len(keys), host_warning(host) is None)
        self.worker = Worker(engine, queue, Isolation(engine, self.history))
        self.model = model or Path(str(engine.target.path)).stem
        self.app = create_app(ServeState(self.worker, self.model, keys, defaults or Defaults(),
                                         drafting=engine.drafter is not None))
        config = uvicorn.Config(self.app, host=host, port=port, access_log=access_log, lifespan="off",
                                log_level="info" if access_log else "warning", timeout_graceful_shutdown=5)
        self._uvicorn = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """http://host:port of the listening socket (after start)."""
        sock = self._uvicorn.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        return f"http://{host if ':' not in host else f'[{host}]'}:{port}"

    def run(self) -> None:
        """Serve in the foreground until Ctrl-C / SIGTERM, then stop the worker."""
        try:
            self._uvicorn.run()
        except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on: here it is the normal stop
            pass
        finally:
            self.worker.close()
        log.info("stopped")

    def start(self, timeout: float = 30.0) -> str:
        """Serve on a background thread; returns the URL once it listens."""
        self._thread = threading.Thread(target=self._uvicorn.run, name="edgespec-serve-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise EdgespecError(f"the server did not start on {self._uvicorn.config.host}:"
                                    f"{self._uvicorn.config.port}")
            time.sleep(0.01)
        return self.url

    def stop(self) -> None:
        """Stop a server started with `start`."""
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(15)
        self.worker.close()

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(target: str | os.PathLike | None = None, drafter: str | os.PathLike | None = "history", *,
          host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, api_key: str | Sequence[str] | None = None,
          queue: int = DEFAULT_QUEUE, history: str = "auto", defaults: Defaults | None = None,
          engine: Engine | None = None, access_log: bool = False, **load_options: Any) -> None:
    """Serve a model over the OpenAI HTTP API until interrupted (`edgespec serve` in Python).

    Args:
        target, drafter: as for `edgespec.load` (ignored when `engine` is given); the drafter defaults
            to "history" here (lookup in earlier requests too: docs/history.md), "ngram" there.
        host: where to listen; anything but loopback logs a warning.
        port: TCP port.
        api_key: Bearer key (or keys, one per client) required on every endpoint but /health.
        queue: most requests waiting behind the running one (beyond: 503 with Retry-After).
        history: "auto" (default), "off", "session" or "global" (see `Server`).
        defaults: sampling values for requests that omit them (edgespec.server.Defaults).
        engine: an Engine already loaded (left open); otherwise one is loaded and closed at the end.
            Either is priced before the first request; a target with no cached cost profile is timed
            while the server is idle instead, and decodes plainly until then (schedule.first_use).
        access_log: log every request.
        **load_options: for `edgespec.load` (backend, n_ctx, threads, n_gpu_layers, num_draft, verbose).
    """
    from edgespec.session import load, price_engine

    import_uvicorn()
    setup_logging()
    warning = host_warning(host)
    if warning:
        log.warning(warning)
    own = engine is None
    engine = load(target, drafter, **load_options) if engine is None else engine
    try:
        # a cached profile: priced before the first request, not during it; none: learned from the first
        # requests and timed while idle (from now until the first request comes), never before a reply
        price_engine(engine, note=log.info, learn=True, background=True)
        server = Server(engine, host=host, port=port, api_key=api_key, queue=queue, history=history,
                        defaults=defaults, access_log=access_log)
        log.info("serving %s at http://%s:%d/v1 (drafter: %s, history: %s)", server.model, host, port,
                 "none" if engine.drafter is None else engine.drafter.name, server.history)
        server.run()
    finally:
        if own:
            engine.close()


def setup_logging() -> None:
    """One line per message on stderr for the `edgespec.server` logger (unless the caller set one up)."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("edgespec serve: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
