"""A target's first use (#48): with no cached cost profile, the first -k auto reply decodes plainly and
times nothing before it; its costs are learned from its steps and an idle timing run after it, which
the next generation, cancel and close stop safely; with a profile cached, nothing changes.

On the tiny GGUF target (tests/conftest.py), each test with its own empty EDGESPEC_HOME. Batched
forwards are timed as cheap (T(k) = 1 + 0.1(k − 1) ms, scaled to the T(1) the reply measured), so the
n-gram drafter pays and the second generation drafts whatever this machine's load."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import edgespec
from edgespec import calibration
from edgespec.drafters.ngram import NgramDrafter
from edgespec.schedule.first_use import StepLog, needs_learning
from edgespec.session import price_engine

PROMPT = "one two three four, one two three four, one two three four, one two three four, one"
TIMERS = ("calibrate", "context_cost", "exact_batch")


@pytest.fixture
def events(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A fresh EDGESPEC_HOME; the list every timing function's call is appended to (they still run)."""
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    seen: list[str] = []
    for name in TIMERS:
        real = getattr(calibration, name)
        monkeypatch.setattr(calibration, name, lambda *a, _real=real, _name=name, **kw: seen.append(_name)
                            or _real(*a, **kw))
    real_prior = NgramDrafter.cost_prior
    monkeypatch.setattr(NgramDrafter, "cost_prior", lambda self, note=None: seen.append("prior")
                        or real_prior(self, note))
    monkeypatch.setattr(calibration, "time_forward", lambda backend, ks, **kw: {k: 1 + 0.1 * (k - 1) for k in ks})
    return seen


def _load(target: Path) -> edgespec.Engine:
    return edgespec.load(str(target), "ngram", n_ctx=512, threads=1)


def test_the_first_reply_is_plain_and_timed_after_it_then_the_next_one_drafts(tiny_target, events):
    with _load(tiny_target) as engine:
        assert engine.pricing.unknown()
        tokens = []
        for chunk in engine.stream(PROMPT, max_tokens=48):
            events.append("token")
            tokens += chunk.tokens
            during = set(events)  # read at each chunk: the idle run starts as the generator ends
        first = engine.last_stats
        assert first.n_drafted == 0 and first.n_planned == 0  # a plain reply: no draft, no plan
        assert during == {"token"}  # nothing was timed before (nor during) it
        assert engine.wait_priced(timeout=60) and engine.idle_error is None
        assert set(events) == {"token", *TIMERS, "prior"}  # timed after it, while idle
        assert not needs_learning(engine.target)  # the profile is cached, with the exact batch
        assert calibration.load_profile(calibration.profile_path(engine.target)).exact_batch is not None
        second = engine.generate(PROMPT, max_tokens=48)
        plain = engine.generate(PROMPT, max_tokens=48, speculative=False)
    assert tokens == plain.tokens == second.tokens
    assert second.stats.n_planned > 0 and second.stats.n_drafted > 0
    assert second.stats.n_prompt_evaluated == 1  # the idle run put the prompt back in the cache


def test_a_cached_profile_prices_at_the_first_generation_as_before(tiny_target, events):
    with _load(tiny_target) as engine:
        engine.calibrate()
    events.clear()
    with _load(tiny_target) as engine:
        assert not engine.pricing.unknown()
        out = engine.generate(PROMPT, max_tokens=48)
        assert out.stats.n_planned > 0 and out.stats.n_drafted > 0
        assert engine._idle_thread is None  # no idle run
    assert set(events) <= set(TIMERS) | {"prior"}  # read from the cache (the functions return it)


def test_the_exact_batch_is_checked_before_the_first_draft(tiny_target, events):
    """A profile with T(k) and the context term but no exact batch (as tests/mtp_fixtures pins one):
    the first generation speculates, and checks the batch first."""
    with _load(tiny_target) as engine:
        t = engine.target
        calibration.save_profile(calibration.profile_path(t), t, t_forward_ms={k: 1 + 0.1 * (k - 1) for k in
                                                                             calibration.CALIBRATION_KS},
                                 context_ms=0.0)
        assert not engine.pricing.unknown() and engine.pricing.exact is None
        real_draft = NgramDrafter.draft

        def draft(self, *a, **kw):
            assert engine.pricing.exact is not None
            events.append("draft")
            return real_draft(self, *a, **kw)
        engine.drafter.draft = draft.__get__(engine.drafter)
        engine.generate(PROMPT, max_tokens=48)
    assert "exact_batch" in events and events.index("exact_batch") < events.index("draft")


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch, events: list[str]) -> tuple[threading.Event, threading.Event]:
    """(started, release): the idle run's T(k) timing sets `started` and waits for `release` (or for
    its stop: the interruptible target's next forward then raises), so a test acts while it runs."""
    started, release = threading.Event(), threading.Event()
    real = calibration.calibrate

    def calibrate(backend, *a, **kw):
        started.set()
        while not release.wait(0.01):
            if getattr(backend, "_stop", threading.Event()).is_set():
                break
        backend.eval([1], rows="all")  # raises Interrupted when stopped
        return real(backend, *a, **kw)
    monkeypatch.setattr(calibration, "calibrate", calibrate)
    return started, release


def test_the_next_generation_stops_the_idle_run_and_equals_plain(tiny_target, held):
    started, release = held
    with _load(tiny_target) as engine:
        first = engine.generate(PROMPT, max_tokens=32)
        assert started.wait(30) and engine.timing
        second = engine.generate(PROMPT, max_tokens=32)  # stops the idle run, does not wait for it
        assert second.stats.n_drafted == 0 and engine.pricing.unknown()  # still learning: plain again
        assert second.stats.n_prompt_evaluated == 1  # the stopped run put the prompt back in the cache
        release.set()
        assert engine.wait_priced(timeout=60)  # the run after the second reply finished the job
        third = engine.generate(PROMPT, max_tokens=32)
        plain = engine.generate(PROMPT, max_tokens=32, speculative=False)
    assert first.tokens == second.tokens == third.tokens == plain.tokens
    assert third.stats.n_drafted > 0


def test_after_two_plain_replies_the_next_one_waits_for_the_idle_run(tiny_target, held):
    """Back-to-back generations would stop every idle run and never speculate: after LEARN_REPLIES
    plain replies the next waits for the run (here released 0.3 s after it starts waiting)."""
    started, release = held
    with _load(tiny_target) as engine:
        outs = [engine.generate(PROMPT, max_tokens=32) for _ in range(2)]  # each stops the run before it
        assert started.wait(30) and engine.timing and engine.pricing.unknown()
        threading.Timer(0.3, release.set).start()
        third = engine.generate(PROMPT, max_tokens=32)
        plain = engine.generate(PROMPT, max_tokens=32, speculative=False)
    assert [o.stats.n_drafted for o in outs] == [0, 0] and third.stats.n_drafted > 0
    assert all(o.tokens == plain.tokens for o in [*outs, third])


@pytest.mark.parametrize("how", ["cancel", "close", "reset"])
def test_cancel_close_or_reset_during_the_idle_run_is_safe(tiny_target, held, how):
    started, _ = held
    engine = _load(tiny_target)
    first = engine.generate(PROMPT, max_tokens=32)
    assert started.wait(30)
    if how == "close":
        engine.close()
        assert not engine.timing
        return
    engine.cancel() if how == "cancel" else engine.reset()
    engine._idle_thread.join(30)
    assert not engine.timing and engine.target.n_past == len(engine._kv)
    again = engine.generate(PROMPT, max_tokens=32)
    assert again.tokens == first.tokens
    engine.close()


def test_load_for_the_cli_times_nothing_and_says_so(tiny_target, events):
    notes: list[str] = []
    with _load(tiny_target) as engine:
        price_engine(engine, notes.append, learn=True)
        assert engine.pricing.t_forward is None and not events and not engine.timing
    assert len(notes) == 1 and "no cost profile" in notes[0]


def test_the_steps_give_t1_and_the_context_term():
    log = StepLog()
    for c in range(64, 320):
        log.add(c, (2.0 + 0.01 * (c - 64) + (0.5 if c % 17 == 0 else 0.0)) / 1000)  # a slow step now and then
    assert log.slope() == pytest.approx(0.01, rel=0.05)
    short = StepLog()
    for c in range(64, 100):
        short.add(c, 0.002)
    assert short.slope() is None  # too narrow a span of contexts to fit the term
