"""The Starlette app: OpenAI-compatible endpoints over one Worker.

GET /health (never behind the key), GET /v1/models, POST /v1/chat/completions, POST /v1/completions
(streamed as server-sent events when "stream": true), POST /v1/history/clear (forget the caller's
history: edgespec.server.isolation). Every refusal is OpenAI's error object and one log line;
nothing returns a traceback.

A client is the API key it sent (its index among the keys; None without keys) and the request's
OpenAI `user` field: the worker isolates clients from each other as --history says.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from edgespec.server.protocol import (
    MAX_BODY,
    ApiError,
    Defaults,
    GenRequest,
    chunk,
    parse_json,
    parse_request,
    parse_user,
    sse,
)
from edgespec.server.protocol import response as full_response
from edgespec.server.worker import Event, Worker

log = logging.getLogger("edgespec.server")

DRAIN_LIMIT = 16 * MAX_BODY  # an oversized body is read (and dropped) up to here, so the client hears the 413


@dataclass(frozen=True)
class ServeState:
    """What the handlers share: the worker, the model id they report, the keys, request defaults."""

    worker: Worker
    model: str
    api_keys: tuple[str, ...] = ()  # any of them is accepted; none: no key asked
    defaults: Defaults = Defaults()
    drafting: bool = False  # a drafter is loaded: timings carry draft_n / draft_n_accepted


def create_app(state: ServeState) -> Starlette:
    """The ASGI app serving `state.worker`'s engine."""

    def endpoint(handler: Callable[[Request], Awaitable[Response]], auth: bool = True) -> Callable:
        async def wrapped(request: Request) -> Response:
            try:
                if auth:
                    request.state.key = _check_key(request, state.api_keys)
                return await handler(request)
            except ApiError as e:
                return _error(request, e)
            except Exception as e:  # a bug must still answer as an error object, in one log line
                log.error("%s %s: %s: %s", request.method, request.url.path, type(e).__name__, e)
                return _error(request, ApiError(500, "internal server error", kind="server_error"), logged=True)
        return wrapped

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", **state.worker.status()})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": state.model, "object": "model", "created": int(time.time()), "owned_by": "edgespec"}]})

    async def chat(request: Request) -> Response:
        return await _generate(request, state, "chat")

    async def completions(request: Request) -> Response:
        return await _generate(request, state, "completion")

    async def clear_history(request: Request) -> Response:
        body = await _read_body(request)
        user = parse_user(parse_json(body)) if body.strip() else ""
        state.worker.clear_history((request.state.key, user))
        return JSONResponse({"object": "history.cleared", "history": state.worker.isolation.mode})

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _error(request, ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                        code="not_found" if exc.status_code == 404 else None))

    routes = [Route("/health", endpoint(health, auth=False)),
              Route("/v1/models", endpoint(models)),
              Route("/v1/chat/completions", endpoint(chat), methods=["POST"]),
              Route("/v1/completions", endpoint(completions), methods=["POST"]),
              Route("/v1/history/clear", endpoint(clear_history), methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})


def _error(request: Request, e: ApiError, logged: bool = False) -> JSONResponse:
    if not logged:
        log.warning("%s %s -> %d: %s", request.method, request.url.path, e.status, e.message)
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _check_key(request: Request, keys: tuple[str, ...]) -> int | None:
    """The index of the key the request sent (None when the server asks for none); 401 otherwise.
    Every key is compared, in constant time, so timing does not tell which one nearly matched."""
    if not keys:
        return None
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    sent = token.strip().encode()
    matches = [hmac.compare_digest(sent, key.encode()) for key in keys]
    if scheme.lower() != "bearer" or not any(matches):
        raise ApiError(401, "invalid or missing API key (send the header Authorization: Bearer <key>)",
                       code="invalid_api_key")
    return matches.index(True)


async def _read_body(request: Request) -> bytes:
    """The body, or 413 past MAX_BODY (read on to DRAIN_LIMIT and dropped, so the client gets the answer)."""
    body, size = bytearray(), 0
    try:
        async for part in request.stream():
            size += len(part)
            if size <= MAX_BODY:
                body += part
            elif size > DRAIN_LIMIT:
                break
    except ClientDisconnect:
        raise ApiError(400, "the client disconnected before the request body was complete") from None
    if size > MAX_BODY:
        raise ApiError(413, f"the request body is over {MAX_BODY} bytes", code="request_too_large")
    return bytes(body)


class _Channel:
    """A job's events, posted from the worker thread into this event loop, read with disconnect watch."""

    def __init__(self, request: Request) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self._gone = asyncio.ensure_future(self._disconnected(request))

    def __call__(self, event: Event) -> None:  # the worker's sink
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    @staticmethod
    async def _disconnected(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def next(self) -> Event | None:
        """The next event, or None once the client has disconnected."""
        get = asyncio.ensure_future(self.queue.get())
        await asyncio.wait({get, self._gone}, return_when=asyncio.FIRST_COMPLETED)
        if get.done():
            return get.result()
        get.cancel()
        return None

    def stop_watching(self) -> None:
        """Hand disconnect detection over (a StreamingResponse watches the connection itself)."""
        self._gone.cancel()


async def _generate(request: Request, state: ServeState, kind: str) -> Response:
    req = parse_request(kind, parse_json(await _read_body(request)), state.defaults)
    channel = _Channel(request)
    job = state.worker.submit(req, channel, client=(request.state.key, req.user))
    handed_over = False
    try:
        first = await channel.next()
        if first is None:
            return _client_gone(request)
        if first.error is not None:
            return _error(request, first.error)
        if req.stream:
            channel.stop_watching()
            handed_over = True
            return _EventStream(_events(req, state, channel, first), lambda: state.worker.cancel(job))
        parts, event = [], first
        while event.kind == "chunk":
            assert event.chunk is not None
            parts.append(event.chunk.text)
            next_event = await channel.next()
            if next_event is None:
                return _client_gone(request)
            event = next_event
        if event.error is not None:
            return _error(request, event.error)
        assert event.stats is not None
        return JSONResponse(full_response(req, state.model, "".join(parts), event.reason, event.stats,
                                          state.drafting))
    finally:
        if not handed_over:
            channel.stop_watching()
            state.worker.cancel(job)  # a no-op for a finished job


class _EventStream(StreamingResponse):
    """A text/event-stream response that runs `on_close` however it ends: a client gone before the
    first chunk was sent cancels the stream before its body iterator ever started."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _client_gone(request: Request) -> Response:
    log.warning("%s %s: the client disconnected; generation cancelled", request.method, request.url.path)
    return Response(status_code=499)


async def _events(req: GenRequest, state: ServeState, channel: _Channel, event: Event) -> AsyncIterator[bytes]:
    """The SSE stream: a role chunk (chat), text deltas, the finish chunk with `timings`, the usage
    chunk when asked for, then [DONE]."""
    model, ended = state.model, False
    try:
        if req.kind == "chat":
            yield sse(chunk(req, model, "", first=True))
        while event.kind == "chunk":
            assert event.chunk is not None
            if event.chunk.text:
                yield sse(chunk(req, model, event.chunk.text))
            event = await channel.queue.get()
        if event.kind == "done":
            yield sse(chunk(req, model, "", event.reason, stats=event.stats, drafting=state.drafting))
            if req.include_usage:
                yield sse(chunk(req, model, None, stats=event.stats, drafting=state.drafting))
        else:
            assert event.error is not None
            log.warning("stream %s ended by an error: %s", req.id, event.error.message)
            yield sse(event.error.body())
        ended = True
        yield sse("[DONE]")
    finally:
        if not ended:  # _EventStream then cancels the job
            log.warning("stream %s: the client disconnected; generation cancelled", req.id)
