"""`edgespec serve --history session|off` under `-k auto`: what one client's requests teach the engine
(the scheduler's acceptance estimates, a chain's, the pair record on disk, the n-gram index) must not
shape another client's drafts or γ. A live server on the tiny GGUF target; client B's request, after
client A taught the server a long repetitive text, must be scheduled and drafted exactly as on a
freshly loaded server that saw only B's request.

Timing is taken out of the comparison: each engine's costs are pinned (no profile is timed, the draft
model's KV handoff is off) and the loop's clock (engine, scheduler, chain) is a fake one that a
target forward of k tokens advances by the pinned T(k) and a draft model's by a tenth of T(1), so
every cycle's timing, and what the cost model learns from it, is a function of the work done: two
engines that know the same schedule the same, cycle for cycle."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

import edgespec
import edgespec.engine
import edgespec.schedule.chain
import edgespec.schedule.scheduler
from edgespec.drafters.base import DraftCost
from edgespec.drafters.chain import members
from edgespec.drafters.ngram import NgramDrafter
from edgespec.engine import Engine
from edgespec.sampling import SamplingParams
from edgespec.server import Server
from edgespec.server.isolation import Isolation

pytestmark = pytest.mark.real  # the tiny GGUFs copy the fetched SmolLM2's tokenizer

KEYS = ("key-alice", "key-bob")
ALICE, BOB = KEYS
# A: a long repetitive text (copies pay: the n-gram's and the chain's acceptance climbs); B: new text
TEACH = {"prompt": "the keeper lit the lamp and the ship came home; " * 24, "max_tokens": 160}
ASK = {"prompt": "A lighthouse keeper and his cat, " * 6 + "a story.", "max_tokens": 64}
T_FORWARD = {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.4, 32: 1.8}  # ms: a bandwidth-bound target
MODEL_COST = DraftCost(0.0, 0.1, catch_up_ms=0.02)  # a draft model at a tenth of the target's step


class Clock:
    """The loop's perf_counter: 1 µs per reading, plus the ms `spend` charges for a forward."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1e-6
        return self.now

    def spend(self, ms: float) -> None:
        self.now += ms / 1000

    def charging(self, backend: object, method: str, ms: Callable[[int], float]) -> None:
        """`backend.method(tokens, ...)` spends ms(len(tokens)) first."""
        real = getattr(backend, method)

        def timed(tokens, *args, **kwargs):
            self.spend(ms(len(tokens)))
            return real(tokens, *args, **kwargs)
        setattr(backend, method, timed)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    fake = SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
    fake.perf_counter = c.perf_counter
    for module in (edgespec.engine, edgespec.schedule.scheduler, edgespec.schedule.chain):
        monkeypatch.setattr(module, "time", fake)
    return c


def _t(k: int) -> float:
    """The pinned T(k) in ms (linear beyond the profile)."""
    ks = sorted(T_FORWARD)
    return float(np.interp(k, ks, [T_FORWARD[j] for j in ks])) if k <= ks[-1] else T_FORWARD[32] * k / 32


def _pin(engine: Engine, clock: Clock) -> Engine:
    """Costs known in advance, and charged on the fake clock: nothing is timed for real."""
    p = engine.pricing
    p.exact, p.t_forward, p.ctx_ms = 32, dict(T_FORWARD), 0.0
    for method in ("eval", "eval_argmax"):
        clock.charging(engine.target, method, _t)
    for d in members(engine.drafter):
        model = getattr(d, "model", None)
        p.draft_cost[d] = MODEL_COST if model is not None else d.cost_prior()
        if model is not None:
            clock.charging(model, "eval", lambda n: MODEL_COST.per_token_ms + MODEL_COST.catch_up_ms * (n - 1))
            d.handoff = None  # copy-or-read is decided on timed costs
    return engine


def _spec(kind: str, tiny_drafter: Path) -> str:
    return {"ngram": "ngram", "history": "history", "chain": f"ngram,{tiny_drafter}", "model": str(tiny_drafter)}[kind]


Run = Callable[..., list[tuple]]


@pytest.fixture
def run(tiny_target: Path, tiny_drafter: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        clock: Clock) -> Iterator[Run]:
    """run(kind, mode, [(key, body), ...]) → per request what it drafted and how it was scheduled,
    on a freshly loaded, pinned server with its own empty EDGESPEC_HOME (no pair record from before)."""
    homes = iter(range(100))

    def go(kind: str, mode: str, requests: list[tuple[str | None, dict | str]]) -> list:
        monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / f"home{next(homes)}"))
        engine = _pin(edgespec.load(str(tiny_target), _spec(kind, tiny_drafter), n_ctx=2048, threads=1,
                                    num_draft="auto"), clock)
        out = []
        try:
            with Server(engine, port=0, api_key=KEYS if mode == "session" else None, history=mode) as srv:
                for key, body in requests:
                    out.append(_clear(srv.url, key) if body == "clear" else _ask(srv.url, key, body, engine))
        finally:
            engine.close()
        return out

    yield go


def _ask(url: str, key: str | None, body: dict, engine: Engine) -> tuple:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(url + "/v1/completions", json={"temperature": 0, **body}, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    s = engine.last_stats  # the request just answered: the worker runs one at a time
    assert s is not None
    return (r.json()["choices"][0]["text"], tuple(s.cycles), dict(s.by_member), s.n_planned, s.n_probes,
            round(s.predicted_tokens, 9), round(s.predicted_s, 12))


def _clear(url: str, key: str | None) -> None:
    r = httpx.post(url + "/v1/history/clear", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)
    assert r.status_code == 200, r.text


def _drafted(record: tuple) -> int:
    return sum(n for n, _ in record[1])


@pytest.mark.parametrize("kind", ["ngram", "history", "chain", "model"])
@pytest.mark.parametrize("mode", ["session", "off"])
def test_a_client_is_scheduled_as_on_a_cold_server(run: Run, kind: str, mode: str) -> None:
    a, b = (ALICE, BOB) if mode == "session" else (None, None)  # off: every request is on its own
    [cold] = run(kind, mode, [(b, ASK)])
    assert _drafted(cold) > 0  # the comparison is about drafting: B does draft
    taught, after = run(kind, mode, [(a, TEACH), (b, ASK)])
    assert _drafted(taught) > 0
    assert after == cold


def test_clear_makes_a_client_cold_again(run: Run) -> None:
    [cold] = run("chain", "session", [(ALICE, ASK)])
    *_, again = run("chain", "session", [(ALICE, TEACH), (BOB, TEACH), (ALICE, "clear"), (ALICE, ASK)])
    assert again == cold


def test_shared_learning_is_what_the_test_catches(run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: with per-client learning switched off (the scheduler and the pair record shared,
    as before issue 49's isolation), B after A is no longer scheduled as cold."""
    [cold] = run("chain", "session", [(BOB, ASK)])
    monkeypatch.setattr(Isolation, "_learn_apart", lambda self, client: None)
    _, after = run("chain", "session", [(ALICE, TEACH), (BOB, ASK)])
    assert after[0] == cold[0]  # the text is the target's: always the same
    assert after != cold


def test_ngram_reset_forgets_its_index() -> None:
    """A context that agrees with the indexed one on its last SYNC_WINDOW tokens looks like an
    extension of it; after reset() nothing of the old one may be drafted from."""
    rng = np.random.default_rng(0)
    ids = [int(t) for t in rng.choice(np.arange(1000, 9000), 190, replace=False)]
    p_a, p_b, shared = ids[:40], ids[40:80], ids[80:]
    old = NgramDrafter()
    greedy, r = SamplingParams(0.0), np.random.default_rng(0)
    assert old.draft(p_a + shared, 4, greedy, r).tokens == []
    b = p_b + shared + p_a[10:14]  # ends with an n-gram only A's context holds
    assert old.draft(b, 4, greedy, r).tokens == p_a[14:18]  # what the index keeps without reset
    old.draft(p_a + shared, 4, greedy, r)
    old.reset()
    assert old.draft(b, 4, greedy, r).tokens == NgramDrafter().draft(b, 4, greedy, r).tokens == []


def test_ngram_server_forgets_the_last_clients_index(tiny_target: Path) -> None:
    """End to end at a fixed γ: bob's token-id prompt agrees with alice's on her last 64 tokens, at the
    same positions, and ends with an n-gram of her prompt; he drafts as on a cold server."""
    rng = np.random.default_rng(1)
    ids = [int(t) for t in rng.choice(np.arange(1000, 9000), 190, replace=False)]
    p_a, p_b, shared = ids[:40], ids[40:80], ids[80:]
    alice = {"prompt": p_a + shared, "max_tokens": 2, "num_draft": 4}
    bob = {"prompt": p_b + shared + p_a[10:14], "max_tokens": 8, "num_draft": 4}

    def serve(requests: list[tuple[str, dict]]) -> list[tuple]:
        with edgespec.load(str(tiny_target), "ngram", n_ctx=2048, threads=1, num_draft=4) as engine:
            with Server(engine, port=0, api_key=KEYS, history="session") as srv:
                return [_ask(srv.url, key, body, engine)[:2] for key, body in requests]

    [cold] = serve([(BOB, bob)])
    assert serve([(ALICE, alice), (BOB, bob)])[1] == cold


def test_pricing_keeps_one_set_of_schedulers_per_scope() -> None:
    """Pricing.use: a scope's schedulers are its own and persist; forget() and eviction make it cold."""
    from edgespec.schedule import pricing as pricing_mod
    from edgespec.schedule.pricing import Pricing

    p = Pricing(SimpleNamespace(recurrent=False, path="none.gguf", name="none"))  # type: ignore[arg-type]
    ngram = NgramDrafter()
    p.exact, p.t_forward, p.ctx_ms, p.draft_cost[ngram] = 32, dict(T_FORWARD), 0.0, None
    own = p.scheduler(ngram, True)
    p.use("alice")
    alice = p.scheduler(ngram, True)
    assert alice is not own and p.scheduler(ngram, True) is alice and p.scheduler(ngram, False) is not alice
    p.use("bob")
    assert p.scheduler(ngram, True) not in (own, alice)
    p.use("alice")
    assert p.scheduler(ngram, True) is alice
    p.forget("alice")
    assert p.scheduler(ngram, True) is not alice
    alice = p.scheduler(ngram, True)
    for i in range(pricing_mod.MAX_SCOPES):  # alice is the least recently used: evicted
        p.use(i)
    p.use("alice")
    assert p.scheduler(ngram, True) is not alice
    p.use(None)
    assert p.scheduler(ngram, True) is own  # the engine's own is never evicted
