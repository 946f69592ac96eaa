"""edgespec.bench.replay: modeled replays of greedy outputs (no model needed)."""

from __future__ import annotations

import pytest

from edgespec.bench import replay
from edgespec.schedule.costs import K_MAX

T = [0.0] + [0.9 + 0.1 * k for k in range(1, K_MAX + 1)]  # T(k) = 0.9 + 0.1·k: T(1) = 1
OUT = list(range(100, 140))  # 40 tokens, each once
HEAD = [5, 6, 7, 8]


def _copy_task() -> replay.Generation:
    """The prompt holds the whole output after HEAD and ends with HEAD: every draft can be right."""
    return replay.Generation("copy", "c", HEAD + OUT + [9] + HEAD, OUT, max_tokens=40)


def test_oracle_of_a_copy_task_by_hand():
    # best: two cycles emitting 40 tokens (K_MAX = 32: e.g. 32 + 8): 2·0.9 + 40·0.1 = 5.8 for 40 T(1)
    assert replay.oracle(_copy_task(), T) == pytest.approx(40 / 5.8)


def test_fixed_and_native_policies_on_a_copy_task():
    speed, cycles = replay.replay(_copy_task(), T, replay.fixed(4))
    assert cycles == [(4, 4)] * 8  # 8 cycles of 5 tokens
    assert speed == pytest.approx(40 / (8 * T[5]))
    speed12, cycles12 = replay.replay(_copy_task(), T, replay.native(12))
    assert cycles12[0] == (12, 12) and speed12 > speed
    assert replay.native(12)(HEAD + OUT + [9] + HEAD, 0) == []


def test_native_needs_three_tokens_to_copy():
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 20, 21, 22, 1, 2, 3, 4, 99, 20, 21]
    # the pattern is the last 3 tokens [99, 20, 21]: no earlier match
    assert replay.native(4)(ctx, 4) == []
    ctx2 = ctx[:-3] + [20, 21, 22, 1, 2, 3]  # [1, 2, 3] occurs at 0 and at 21: the latest match wins
    assert replay.native(4)(ctx2, 4) == [4, 20, 21, 22]
    late = list(range(30, 60)) + [7, 8, 9, 40, 7, 8, 9]  # the match at 30: 40, 7, 8 follow it
    assert replay.native(4)(late, 4) == [40, 7, 8]
    short = list(range(30, 60)) + [7, 8, 9, 7, 8, 9]  # the latest match leaves 2 to copy: no draft
    assert replay.native(4)(short, 4) == []


def test_auto_plain_on_unpredictable_text_and_near_the_oracle_on_a_copy():
    novel = replay.Generation("novel", "n", [1, 2, 3], list(range(200, 240)), max_tokens=40)
    sched = replay.Scheduler(replay.CostModel({k: T[k] for k in range(1, 17)}))
    speed, cycles = replay.replay(novel, T, sched)
    assert speed == pytest.approx(1.0) and all(g == 0 for g, _ in cycles)
    speed, cycles = replay.replay(_copy_task(), T, sched)
    assert replay.oracle(_copy_task(), T) >= speed > 2.0
    assert all(n == g for g, n in cycles)  # every verified draft was right


def test_context_cost_by_hand():
    # 100 filler tokens before the copy task: every forward pays a per query token and cached token
    filler = list(range(1000, 1100))
    g = replay.Generation("copy", "c", filler + HEAD + OUT + [9] + HEAD, OUT, max_tokens=40)
    c = replay.true_costs(T, ctx_ms=0.01)
    kv0 = len(g.prompt) - 1
    assert c.t_verify(kv0)[5] == pytest.approx(T[5] + 5 * 0.01 * (kv0 - replay.PROFILE_CONTEXT))
    assert c.t_verify(10)[3] == T[3]  # no credit below the profile's own context
    speed, cycles = replay.replay(g, c, replay.fixed(4))
    assert cycles == [(4, 4)] * 8
    plain = sum(T[1] + 0.01 * (kv0 + j - replay.PROFILE_CONTEXT) for j in range(40))
    spec = sum(T[5] + 5 * 0.01 * (kv0 + 5 * i - replay.PROFILE_CONTEXT) for i in range(8))
    assert speed == pytest.approx(plain / spec)
    # attention is not shared by a batch, so context lowers every speedup, the oracle's included
    assert speed < replay.replay(g, T, replay.fixed(4))[0]
    assert replay.oracle(g, c) < replay.oracle(g, T)
