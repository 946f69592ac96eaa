"""Load on a live loopback server: 4 concurrent clients × 25 requests (chat and completions, streamed
and not, greedy and T = 0.7). Every request is answered, every greedy reply equals its own expected
text (so none is lost or mixed up), RSS after the run stays within 5% of RSS after warm-up; the
median latency and the throughput are printed (docs/serve.md records them)."""

from __future__ import annotations

import gc
import statistics
import threading
import time
from pathlib import Path

import openai
import pytest

import edgespec
from edgespec.server import Defaults, Server

pytestmark = pytest.mark.real  # the fixtures copy the fetched SmolLM2's tokenizer

CLIENTS, REQUESTS, MAX_TOKENS = 4, 25, 24
TOPICS = ["rivers", "bread", "chess", "owls", "glass", "tides", "maps", "bells"]


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def _plan(client: int) -> list[dict]:
    """This client's requests: its own two topics, cycling through chat/completion × stream × T."""
    out = []
    for i in range(REQUESTS):
        topic = TOPICS[2 * client + i % 2]
        out.append({"chat": i % 4 < 2, "stream": i % 2 == 0, "greedy": i % 3 != 2, "topic": topic,
                    "seed": 1000 * client + i})
    return out


def _ask(client: openai.OpenAI, r: dict) -> tuple[str, str, int]:
    """(text, finish_reason, completion tokens) of one request."""
    kw = dict(model="tiny", max_tokens=MAX_TOKENS, temperature=0.0 if r["greedy"] else 0.7, seed=r["seed"])
    if r["chat"]:
        kw["messages"] = [{"role": "user", "content": f"Tell me about {r['topic']}."}]
        call = client.chat.completions.create
    else:
        kw["prompt"] = f"A short note on {r['topic']}:"
        call = client.completions.create
    if not r["stream"]:
        resp = call(**kw)
        c = resp.choices[0]
        return (c.message.content if r["chat"] else c.text), c.finish_reason, resp.usage.completion_tokens
    parts, reason, n = [], "", -1
    for ch in call(**kw, stream=True, stream_options={"include_usage": True}):
        if ch.choices:
            piece = ch.choices[0].delta.content if r["chat"] else ch.choices[0].text
            parts.append(piece or "")
            reason = ch.choices[0].finish_reason or reason
        if ch.usage is not None:
            n = ch.usage.completion_tokens
    return "".join(parts), reason, n


def test_four_clients_in_parallel(tiny_target: Path, tiny_drafter: Path) -> None:
    opts = dict(n_ctx=1024, threads=1, num_draft=3)
    with edgespec.load(str(tiny_target), str(tiny_drafter), **opts) as engine, \
            edgespec.load(str(tiny_target), str(tiny_drafter), **opts) as ref:
        expected = {}
        for topic in TOPICS:
            expected[True, topic] = ref.chat([{"role": "user", "content": f"Tell me about {topic}."}],
                                             max_tokens=MAX_TOKENS).text
            expected[False, topic] = ref.generate(f"A short note on {topic}:", max_tokens=MAX_TOKENS).text
        with Server(engine, port=0, defaults=Defaults(temperature=0.0)) as server:
            clients = [openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
                       for _ in range(CLIENTS)]
            for r in _plan(0)[:8]:  # warm-up: every request shape once
                _ask(clients[0], r)
            gc.collect()
            rss_warm = _rss_mb()
            results: list[list[tuple]] = [[] for _ in range(CLIENTS)]
            errors: list[BaseException] = []

            def run(k: int) -> None:
                try:
                    for r in _plan(k):
                        t0 = time.perf_counter()
                        text, reason, n = _ask(clients[k], r)
                        results[k].append((r, text, reason, n, time.perf_counter() - t0))
                except BaseException as e:  # reported below: a thread must not swallow it
                    errors.append(e)

            t_start = time.perf_counter()
            threads = [threading.Thread(target=run, args=(k,)) for k in range(CLIENTS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            wall = time.perf_counter() - t_start
            gc.collect()
            rss_end = _rss_mb()
            status = server.worker.status()
    assert not errors, errors
    done = [row for rows in results for row in rows]
    assert len(done) == CLIENTS * REQUESTS and status["waiting"] == 0 and status["cancelled"] == 0
    for r, text, reason, n, _ in done:
        assert reason in ("stop", "length") and 0 < n <= MAX_TOKENS
        if r["greedy"]:
            assert text == expected[r["chat"], r["topic"]], r
    latencies = sorted(row[4] for row in done)
    tokens = sum(row[3] for row in done)
    print(f"\nserve load: {len(done)} requests from {CLIENTS} clients in {wall:.1f} s; median latency "
          f"{statistics.median(latencies) * 1000:.0f} ms (p90 {latencies[int(0.9 * len(latencies))] * 1000:.0f} ms); "
          f"{tokens / wall:.0f} completion tok/s; RSS {rss_warm:.0f} → {rss_end:.0f} MiB")
    assert abs(rss_end - rss_warm) <= 0.05 * rss_warm
