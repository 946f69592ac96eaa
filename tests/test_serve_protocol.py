"""The server's pieces without a model: request validation, response shapes, the worker's queue and
cancellation (on a fake engine), the lazy export, the loopback warning, the CLI's early checks."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from edgespec.cli import app as cli
from edgespec.engine import Chunk
from edgespec.errors import ContextOverflowError, EdgespecError
from edgespec.server import ApiError, Defaults, Server, host_warning
from edgespec.server.protocol import chunk, parse_json, parse_request, response, timings
from edgespec.server.worker import Event, Worker
from edgespec.stats import Stats


def wait_idle(worker: Worker, timeout: float) -> bool:
    """Whether the worker is idle (nothing runs or waits) within `timeout` seconds, by its status."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = worker.status()
        if not s["generating"] and not s["waiting"]:
            return True
        time.sleep(0.01)
    return False

MSG = [{"role": "user", "content": "hi"}]


def _error(kind: str, body: dict) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_request(kind, body, Defaults())
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -1), ("temperature", "hot"), ("top_p", 1.5), ("top_p", 0), ("top_k", -1), ("top_k", 1.5),
    ("min_p", 1.0), ("max_tokens", 0), ("max_completion_tokens", -3), ("seed", "x"), ("stop", 5),
    ("stop", ["a"] * 17), ("num_draft", "lots"), ("num_draft", -1), ("n", 2), ("stream", "yes"),
])
def test_invalid_fields_are_400_naming_the_field(field: str, value: object) -> None:
    err = _error("chat", {"messages": MSG, field: value})
    assert err.param == field and field in err.message
    assert err.body()["error"].keys() == {"message", "type", "param", "code"}


@pytest.mark.parametrize(("kind", "body", "param"), [
    ("chat", {}, "messages"), ("chat", {"messages": []}, "messages"), ("chat", {"messages": [{"content": "x"}]},
                                                                        "messages"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("completion", {}, "prompt"), ("completion", {"prompt": ""}, "prompt"), ("completion", {"prompt": ["a", "b"]},
                                                                             "prompt"),
])
def test_missing_or_malformed_input(kind: str, body: dict, param: str) -> None:
    assert _error(kind, body).param == param


def test_valid_requests_and_defaults() -> None:
    d = Defaults(max_tokens=99, temperature=0.3, seed=7, num_draft=2)
    req = parse_request("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                           {"type": "text", "text": "b"}]}],
                                 "model": "whatever", "frobnicate": True, "stop": "x", "n": 1,
                                 "stream": True, "stream_options": {"include_usage": True}}, d)
    assert req.messages == [{"role": "user", "content": "ab"}]
    assert req.options == {"temperature": 0.3, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "max_tokens": 99,
                           "seed": 7, "stop": ("x",), "num_draft": 2}
    assert req.stream and req.include_usage and req.id.startswith("chatcmpl-")
    req = parse_request("completion", {"prompt": ["once"], "max_completion_tokens": 5, "temperature": 0,
                                       "num_draft": "auto", "stop": ["a", "b"]}, Defaults())
    assert req.prompt == "once" and req.options["max_tokens"] == 5 and req.options["num_draft"] == "auto"
    assert not req.include_usage and req.options["stop"] == ("a", "b")
    assert parse_request("completion", {"prompt": [1, 2, 3]}, Defaults()).prompt == [1, 2, 3]
    with pytest.raises(EdgespecError, match="top_p"):
        Defaults(top_p=2)


@pytest.mark.parametrize("body", [b"{bad", b"[1, 2]", b"\xff\xfe", b""])
def test_malformed_json(body: bytes) -> None:
    with pytest.raises(ApiError) as info:
        parse_json(body)
    assert info.value.status == 400


def test_response_shapes() -> None:
    stats = Stats(n_prompt=10, n_prompt_evaluated=4, n_tokens=6, t_prefill=0.002, t_verify=0.03)
    stats.cycles = [(3, 2), (3, 1), (0, 0)]
    req = parse_request("chat", {"messages": MSG}, Defaults())
    out = response(req, "m", "hello", "eos", stats, drafting=True)
    assert out["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"] == {"prompt_tokens": 10, "completion_tokens": 6, "total_tokens": 16}
    t = out["timings"]
    assert (t["prompt_n"], t["cache_n"], t["predicted_n"], t["draft_n"], t["draft_n_accepted"]) == (4, 6, 6, 6, 3)
    assert t["tau"] == pytest.approx(2.0) and t["predicted_per_second"] == pytest.approx(200.0)
    assert "draft_n" not in timings(stats, drafting=False)
    assert response(req, "m", "", "length", stats, False)["choices"][0]["finish_reason"] == "length"
    first = chunk(req, "m", "", first=True)["choices"][0]["delta"]
    assert first == {"role": "assistant", "content": ""}
    assert chunk(req, "m", "x")["choices"][0]["delta"] == {"content": "x"}
    last = chunk(req, "m", "", "stop", stats=stats, drafting=True)
    assert last["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert "timings" in last and "usage" not in last
    usage_chunk = chunk(req, "m", None, stats=stats, drafting=True)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["total_tokens"] == 16


def test_host_warning() -> None:
    assert all(host_warning(h) is None for h in ("127.0.0.1", "::1", "localhost", "127.0.0.2"))
    assert "0.0.0.0" in (host_warning("0.0.0.0") or "") and host_warning("192.168.1.5") is not None


def test_serve_warns_off_loopback(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from edgespec.server import runner

    ran: list[Server] = []
    monkeypatch.setattr(runner.Server, "run", lambda self: ran.append(self))  # nothing binds
    with caplog.at_level(logging.INFO, logger="edgespec.server"):
        runner.serve(engine=GateEngine(), host="0.0.0.0", port=0)  # type: ignore[arg-type]
        runner.serve(engine=GateEngine(), port=0)  # type: ignore[arg-type]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(ran) == 2 and len(warnings) == 1 and "0.0.0.0" in warnings[0] and "--api-key" in warnings[0]
    for server in ran:
        server.worker.close()


def test_import_edgespec_does_not_import_the_server() -> None:
    code = ("import sys, edgespec; assert 'starlette' not in sys.modules and 'edgespec.server' not in sys.modules;"
            "import inspect; assert inspect.isfunction(edgespec.serve); import edgespec.server.app;"
            "assert inspect.isfunction(edgespec.serve)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_cli_checks_flags_before_loading(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(cli.app, ["serve", "--target", str(tmp_path / "x.gguf"), "--top-p", "2"])
    assert result.exit_code == 1
    [line] = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert line.startswith("error: ") and "top_p" in line


# -- the worker on a fake engine -----------------------------------------------------------------------


class GateEngine:
    """Yields one chunk per step, each step waiting for `gate`; honours cancel() like Engine."""

    def __init__(self, steps: int = 5, fail: Exception | None = None) -> None:
        self.target = SimpleNamespace(path="fake.gguf")
        self.drafter = None
        self.num_draft = 3
        self.steps, self.fail = steps, fail
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.produced = 0
        self.last_stats: Stats | None = None
        self._cancel = threading.Event()

    def stream(self, prompt: object, **kw: object) -> Iterator[Chunk]:
        if self.fail is not None:
            raise self.fail
        self._cancel.clear()
        self.last_stats = Stats(n_prompt=1)
        self.started.set()
        for i in range(self.steps):
            self.gate.wait(10)
            if self._cancel.is_set():
                yield Chunk("", [], [], "cancelled")
                return
            self.produced += 1
            self.last_stats.n_tokens = i + 1
            yield Chunk(f"{prompt}{i} ", [i], [False], "length" if i == self.steps - 1 else None)

    def cancel(self) -> None:
        self._cancel.set()


class Sink:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.done = threading.Event()

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        if event.kind != "chunk":
            self.done.set()

    @property
    def text(self) -> str:
        return "".join(e.chunk.text for e in self.events if e.chunk is not None)


def _req(prompt: str):
    return parse_request("completion", {"prompt": prompt}, Defaults())


def test_worker_queue_is_fifo_and_bounded() -> None:
    engine = GateEngine(steps=2)
    engine.gate.clear()
    worker = Worker(engine, max_waiting=2)  # type: ignore[arg-type]
    try:
        sinks = [Sink() for _ in range(3)]
        jobs = [worker.submit(_req(p), s) for p, s in zip("abc", sinks)]
        assert engine.started.wait(5)
        with pytest.raises(ApiError) as info:  # one running + two waiting: the fourth is refused
            worker.submit(_req("d"), Sink())
        assert info.value.status == 503 and info.value.headers["Retry-After"] == "1"
        assert worker.status()["waiting"] == 2
        engine.gate.set()
        assert all(s.done.wait(5) for s in sinks)
        assert [s.text for s in sinks] == ["a0 a1 ", "b0 b1 ", "c0 c1 "]
        assert all(s.events[-1].kind == "done" and s.events[-1].reason == "length" for s in sinks)
        assert worker.status() == {"generating": False, "waiting": 0, "done": 3, "cancelled": 0,
                                   "history": "global"} and jobs
    finally:
        worker.close()


def test_worker_cancel_waiting_and_running_within_one_step() -> None:
    engine = GateEngine(steps=50)
    engine.gate.clear()
    worker = Worker(engine, max_waiting=1)  # type: ignore[arg-type]
    try:
        running, waiting = Sink(), Sink()
        job = worker.submit(_req("a"), running)
        assert engine.started.wait(5)
        queued = worker.submit(_req("b"), waiting)
        worker.cancel(queued)
        assert worker.status()["waiting"] == 0  # a cancelled waiting request frees its place at once
        worker.cancel(job)
        engine.gate.set()
        assert wait_idle(worker, 5)
        assert engine.produced <= 1 and not waiting.events  # stopped at the next step; b never ran
        assert worker.status()["cancelled"] == 2 and not running.done.is_set()
        after = Sink()
        worker.submit(_req("c"), after)
        assert after.done.wait(5) and after.text.startswith("c0 c1 ")
    finally:
        worker.close()


@pytest.mark.parametrize(("fail", "status", "code"), [
    (ContextOverflowError("prompt of 9 tokens does not fit"), 400, "context_length_exceeded"),
    (EdgespecError("bad template"), 400, None),
    (RuntimeError("llama_decode returned -1"), 500, None),
])
def test_worker_turns_engine_errors_into_api_errors(fail: Exception, status: int, code: str | None) -> None:
    engine = GateEngine(fail=fail)
    worker = Worker(engine, max_waiting=1)  # type: ignore[arg-type]
    try:
        sink = Sink()
        worker.submit(_req("a"), sink)
        assert sink.done.wait(5)
        [event] = sink.events
        assert event.kind == "error" and event.error is not None
        assert (event.error.status, event.error.code) == (status, code)
        assert "Traceback" not in event.error.message and "\n" not in event.error.message
    finally:
        worker.close()


def test_an_engine_busy_elsewhere_is_a_503_not_a_400():
    """The engine refuses a second concurrent generation with EngineBusyError: a client may retry."""
    import threading

    from edgespec.errors import EngineBusyError
    from edgespec.server.protocol import GenRequest
    from edgespec.server.worker import Job, Worker

    class Busy:
        drafter = None

        def stream(self, prompt, **kw):
            raise EngineBusyError("this engine is already generating; use one engine per concurrent stream")
            yield  # a generator, as Engine.stream is

    events, done = [], threading.Event()
    worker = Worker(Busy())
    worker._run(Job(GenRequest(kind="completion", prompt="hi"), lambda e: (events.append(e), done.set())))
    assert events[0].kind == "error" and events[0].error.status == 503
    assert events[0].error.headers["Retry-After"]
