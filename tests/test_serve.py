"""`edgespec serve` against a live server on 127.0.0.1 (a free port), driven by the official `openai`
client and by raw HTTP for the error cases. The models are the tiny GGUF fixtures (a random llama
with SmolLM2's tokenizer and chat template, and a perturbed copy of it as a draft model): every
greedy reply must equal Engine.chat / Engine.generate on an identically loaded engine."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from test_serve_protocol import wait_idle

import edgespec
from edgespec.engine import Engine
from edgespec.server import Defaults, Server

pytestmark = pytest.mark.real  # the fixtures copy the fetched SmolLM2's tokenizer

N_CTX = 4096
CHATS = [[{"role": "user", "content": "Write a haiku about the sea."}],
         [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]]
PROMPTS = ["The quick brown fox", "def fibonacci(n):"]
LONG = 3600  # tokens: a generation that runs for seconds (~1 ms a token on the tiny pair), to be interrupted


def _load(target: Path, drafter: str | None) -> Engine:
    return edgespec.load(str(target), drafter, n_ctx=N_CTX, threads=1, num_draft=3)


@dataclass
class Live:
    engine: Engine  # the server's
    ref: Engine  # loaded the same way; expected texts come from it
    server: Server
    url: str
    client: openai.OpenAI


@pytest.fixture(scope="module")
def stacks(tiny_target: Path, tiny_drafter: Path) -> Iterator[Callable[[str], Live]]:
    opened: dict[str, Live] = {}

    def get(kind: str) -> Live:
        if kind not in opened:
            spec = "ngram" if kind == "ngram" else str(tiny_drafter)
            engine, ref = _load(tiny_target, spec), _load(tiny_target, spec)
            server = Server(engine, port=0, defaults=Defaults(temperature=0.0))
            url = server.start()
            opened[kind] = Live(engine, ref, server, url, openai.OpenAI(base_url=url + "/v1", api_key="none",
                                                                        max_retries=0, timeout=60))
        return opened[kind]

    yield get
    for live in opened.values():
        live.server.stop()
        live.engine.close()
        live.ref.close()


@pytest.fixture(params=["ngram", "draft-model"])
def live(request: pytest.FixtureRequest, stacks: Callable[[str], Live]) -> Live:
    return stacks(request.param)


@pytest.fixture
def drafted(stacks: Callable[[str], Live]) -> Live:
    return stacks("draft-model")


def _stream_text(stream: openai.Stream, chat: bool) -> tuple[str, list]:
    parts, chunks = [], []
    for c in stream:
        chunks.append(c)
        if c.choices:
            piece = c.choices[0].delta.content if chat else c.choices[0].text
            parts.append(piece or "")
    return "".join(parts), chunks


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_engine_chat(live: Live, stream: bool) -> None:
    for messages in CHATS:
        want = live.ref.chat(messages, max_tokens=40)
        text, add_bos = live.ref.chat_prompt(messages)
        prompt_ids = live.ref.target.tokenize(text, add_bos, True)
        kw = dict(model="tiny", messages=messages, max_tokens=40, temperature=0)
        if stream:
            text, chunks = _stream_text(live.client.chat.completions.create(
                **kw, stream=True, stream_options={"include_usage": True}), chat=True)
            finish = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
            reason, usage, timings = finish.choices[0].finish_reason, chunks[-1].usage, chunks[-1].model_extra["timings"]
            assert chunks[0].choices[0].delta.role == "assistant" and "timings" in finish.model_extra
        else:
            r = live.client.chat.completions.create(**kw)
            text, reason, usage, timings = (r.choices[0].message.content, r.choices[0].finish_reason, r.usage,
                                            r.model_extra["timings"])
        assert text == want.text
        assert reason == {"eos": "stop", "length": "length"}[want.finish_reason]
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), len(want.tokens))
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert timings["predicted_n"] == len(want.tokens) and timings["draft_n"] >= 0 and timings["tau"] >= 1


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_engine_generate(live: Live, stream: bool) -> None:
    for prompt in PROMPTS:
        want = live.ref.generate(prompt, max_tokens=32)
        kw = dict(model="tiny", prompt=prompt, max_tokens=32, temperature=0)
        if stream:
            text, chunks = _stream_text(live.client.completions.create(
                **kw, stream=True, stream_options={"include_usage": True}), chat=False)
            usage = chunks[-1].usage
        else:
            r = live.client.completions.create(**kw)
            text, usage = r.choices[0].text, r.usage
        assert text == want.text
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(live.ref.target.tokenize(prompt, True, False)),
                                                                  len(want.tokens))


def test_stop_strings(live: Live) -> None:
    full = live.ref.generate(PROMPTS[0], max_tokens=32).text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    want = live.ref.generate(PROMPTS[0], max_tokens=32, stop=[stop])
    assert want.finish_reason == "stop" and stop not in want.text
    r = live.client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=32, temperature=0, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want.text, "stop")
    text, chunks = _stream_text(live.client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=32, temperature=0, stop=stop, stream=True), chat=False)
    assert text == want.text and chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_matches_the_engine(drafted: Live) -> None:
    want = drafted.ref.chat(CHATS[0], max_tokens=24, temperature=0.7, top_p=0.9, seed=11)
    r = drafted.client.chat.completions.create(model="tiny", messages=CHATS[0], max_tokens=24, temperature=0.7,
                                               top_p=0.9, seed=11)
    assert r.choices[0].message.content == want.text


def test_timings_report_drafts_and_the_kv_prefix_is_reused(drafted: Live) -> None:
    first = drafted.client.chat.completions.create(model="tiny", messages=CHATS[1], max_tokens=16, temperature=0)
    t = first.model_extra["timings"]
    assert t["draft_n"] > 0 and 0 <= t["draft_n_accepted"] <= t["draft_n"] and t["predicted_per_second"] > 0
    turn = CHATS[1] + [{"role": "assistant", "content": first.choices[0].message.content},
                       {"role": "user", "content": "And three more."}]
    second = drafted.client.chat.completions.create(model="tiny", messages=turn, max_tokens=16, temperature=0)
    t2 = second.model_extra["timings"]
    assert t2["cache_n"] >= first.usage.prompt_tokens - 1  # the previous turn's prompt came from the KV cache
    assert t2["prompt_n"] + t2["cache_n"] == second.usage.prompt_tokens
    assert second.choices[0].message.content == drafted.ref.chat(turn, max_tokens=16).text


def test_models_and_health(drafted: Live) -> None:
    [model] = drafted.client.models.list().data
    assert model.id == "tiny_target" and model.owned_by == "edgespec"
    health = httpx.get(drafted.url + "/health").json()
    assert health["status"] == "ok" and health["generating"] is False


def _wait_cancelled(live: Live, before: int) -> None:
    deadline = time.monotonic() + 20
    while live.server.worker.status()["cancelled"] == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert wait_idle(live.server.worker, 20)
    assert live.server.worker.status()["cancelled"] == before + 1


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_cancels_and_the_next_answer_is_right(drafted: Live, stream: bool) -> None:
    before = drafted.server.worker.status()["cancelled"]
    body = {"messages": CHATS[0], "max_tokens": LONG, "temperature": 0, "stream": stream}
    if stream:
        with httpx.stream("POST", drafted.url + "/v1/chat/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ") and next(lines) == ""
            t_close = time.monotonic()
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(drafted.url + "/v1/chat/completions", json=body, timeout=0.5)
        t_close = time.monotonic()
    _wait_cancelled(drafted, before)
    stats = drafted.engine.last_stats
    assert stats is not None and stats.n_tokens < LONG // 3, stats.n_tokens  # stopped long before the limit
    assert time.monotonic() - t_close < 5
    want = drafted.ref.chat(CHATS[1], max_tokens=24)
    r = drafted.client.chat.completions.create(model="tiny", messages=CHATS[1], max_tokens=24, temperature=0)
    assert r.choices[0].message.content == want.text


KEY = "sekret-key"


def test_queue_overflow_is_503_and_the_api_key_is_checked(drafted: Live) -> None:
    """A second server (on the reference engine) with room for one waiting request and a key."""
    auth = {"Authorization": f"Bearer {KEY}"}
    with Server(drafted.ref, port=0, queue=1, api_key=KEY) as srv:
        url = srv.url
        assert httpx.get(url + "/health").status_code == 200  # /health needs no key
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.get(url + "/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/models", headers=auth).status_code == 200
        body = {"messages": CHATS[0], "max_tokens": LONG, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=auth, timeout=30) as running:
            lines = running.iter_lines()  # kept: a dropped iterator closes the connection
            assert next(lines).startswith("data: ")  # generating now
            with httpx.Client(timeout=30) as waiting_client:
                waiting = waiting_client.build_request("POST", url + "/v1/completions", headers=auth,
                                                       json={"prompt": PROMPTS[0], "max_tokens": 4})
                result: list[httpx.Response] = []
                thread = threading.Thread(target=lambda: result.append(waiting_client.send(waiting)))
                thread.start()
                deadline = time.monotonic() + 10
                while srv.worker.status()["waiting"] < 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                over = httpx.post(url + "/v1/completions", headers=auth, json={"prompt": "x", "max_tokens": 2})
                assert over.status_code == 503 and over.headers["Retry-After"] == "1"
                assert over.json()["error"]["type"] == "server_error"
                running.close()  # the long one is cancelled; the waiting one then runs
                thread.join(30)
        assert result and result[0].status_code == 200 and result[0].json()["choices"][0]["text"]


def _post(live: Live, path: str, body: object, **kw: object) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(live.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=30,
                      **kw)


TOO_LONG = " ".join(["word"] * (2 * N_CTX))


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), [
    ("/v1/chat/completions", b"{not json", 400, None, None),
    ("/v1/chat/completions", {"messages": CHATS[0], "temperature": -0.5}, 400, "temperature", None),
    ("/v1/chat/completions", {"messages": CHATS[0], "top_p": 1.5}, 400, "top_p", None),
    ("/v1/chat/completions", {"messages": CHATS[0], "top_k": -1}, 400, "top_k", None),
    ("/v1/chat/completions", {"messages": CHATS[0], "min_p": 1.0}, 400, "min_p", None),
    ("/v1/chat/completions", {"messages": CHATS[0], "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/chat/completions", {"messages": CHATS[0], "n": 2}, 400, "n", None),
    ("/v1/chat/completions", {"messages": CHATS[0], "num_draft": "many"}, 400, "num_draft", None),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages", None),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": TOO_LONG}]}, 400, "messages",
     "context_length_exceeded"),
    ("/v1/completions", {"prompt": TOO_LONG, "stream": True}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", b"{" + b" " * (1 << 20) + b"}", 413, None, "request_too_large"),
    ("/v1/nothing-here", {}, 404, None, "not_found"),
])
def test_errors_are_openai_error_objects_logged_in_one_line(
        drafted: Live, caplog: pytest.LogCaptureFixture, path: str, body: object, status: int,
        param: str | None, code: str | None) -> None:
    with caplog.at_level(logging.WARNING, logger="edgespec.server"):
        r = _post(drafted, path, body)
        time.sleep(0.05)  # the record is written by the server's thread
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error.keys() == {"message", "type", "param", "code"} and (error["param"], error["code"]) == (param, code)
    if param and not code:
        assert param in error["message"]
    assert "Traceback" not in r.text
    [record] = [rec for rec in caplog.records if rec.name == "edgespec.server"]
    assert "\n" not in record.getMessage() and str(status) in record.getMessage()
    assert drafted.client.completions.create(model="t", prompt="ok", max_tokens=2).choices[0].text  # still serving


def test_unknown_fields_are_ignored(drafted: Live) -> None:
    r = _post(drafted, "/v1/chat/completions", {"messages": CHATS[0], "max_tokens": 4, "temperature": 0,
                                                "logit_bias": {"1": 5}, "user": "me", "frobnicate": [1]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == \
        drafted.ref.chat(CHATS[0], max_tokens=4).text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_cli_serves_and_stops_on_ctrl_c(tiny_target: Path) -> None:
    port = _free_port()
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.Popen([sys.executable, "-m", "edgespec.cli.app", "serve", "--target", str(tiny_target),
                             "-k", "3", "--ctx", "512", "--threads", "1", "--port", str(port),
                             "--api-key", KEY, "--temp", "0"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        r = client.chat.completions.create(model="x", messages=CHATS[0], max_tokens=8)  # --temp 0: greedy default
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and f"127.0.0.1:{port}/v1" in err and "stopped" in err
    assert "drafter: history, history: session" in err  # the server's defaults
