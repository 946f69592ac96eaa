"""The replay gate (#48): `-k auto` replayed over the frozen drafter traces (tests/fixtures/traces/) on
every bundled device must stay ≥ 0.98× plain in every category median and ≥ 0.95× on every task, and
under 0.97× the best fixed γ in at most 10% of the (device, trace set, category) cells (edgespec.bench.
replay.check), greedy and sampled. Plus: the gate catches the K_MAX 16 → 32 regression of 7bc0b09."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_replay import bandwidth_bound, random_trace, trace_set

from edgespec.bench import replay
from edgespec.schedule import scheduler as sched_mod

TRACES = Path(__file__).parent / "fixtures" / "traces"


def test_auto_passes_the_gate_on_the_frozen_traces():
    sets = replay.load_sets(TRACES) if TRACES.is_dir() else []
    if not sets:
        pytest.skip(f"no recorded traces in {TRACES} yet (edgespec/bench/record.py writes them)")
    from edgespec.bench.devices import bundled, load_device

    results = replay.replay_all(sets, [load_device(d) for d in bundled()])
    assert {ts.temperature == 0 for ts in sets} >= {True}, "the gate needs greedy traces"
    fails = replay.check(results)
    assert not fails, "\n".join(fails)


def _old_free(self) -> bool:
    """Scheduler.free as it was at f1c3d41^ (K_MAX already 32 since 7bc0b09): judged per token."""
    return self.cost.t_draft()[1] < sched_mod.FREE_DRAFT * self.cost.t_verify()[1]


def _head_set():
    """Synthetic EAGLE-3 head traces (the recorded ones may not exist): right ~55% a token, its
    confidence honest-ish, two categories, greedy."""
    rng = np.random.default_rng(48)
    return trace_set([random_trace(rng, f"h{i}", n=128, hit=0.55, category=f"c{i % 2}", confident=True)
                      for i in range(6)], kind="head")


def test_the_gate_catches_the_k_max_32_shadow_head_regression(monkeypatch):
    # commit f1c3d41: the shipped EAGLE-3 head at ~1 ms a token beside SmolLM2 F32's 22 ms step passed
    # the per-token free rule, so it drafted 31 tokens in shadow every cycle (0.41-0.98x plain)
    ts, dev = _head_set(), bandwidth_bound(head_ms=1.0)
    recorded = [h for h in (replay.load_sets(TRACES) if TRACES.is_dir() else []) if h.kind == "head"]
    today = replay.check({dev.name: {"head": replay.replay_set(ts, dev)}})
    assert not today, today
    monkeypatch.setattr(sched_mod.Scheduler, "free", property(_old_free))
    before = {dev.name: {"head": replay.replay_set(ts, dev)}}
    fails = replay.check(before)
    assert fails and replay.total(before[dev.name]["head"]["auto"]) < 0.9, fails
    if recorded:  # the recorded head traces too, at that commit's costs (the bundled devices price a
        # head at ≥ 6% of T(1) a token, where the old rule did not call it free)
        assert replay.check(replay.replay_all(recorded, [dev]))
