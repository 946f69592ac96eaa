"""Draft-length controllers other engines ship, for edgespec.bench.replay to replay beside `-k auto`.

Each is rewritten here from the behaviour of its source (facts carried over, no code): a controller
is asked, every cycle, how many tokens to draft (`ask`), may cut the draft by its confidences
(`keep`), and hears what the cycle gave (`feedback`). One controller object lives for a whole
trace set (one server, one process), as it would in its engine; `start` marks a new request.

- `Fixed(γ)`: a constant draft length (MTPLX `tune` picks the best one per device and drafter:
  replay's `best-fixed`).
- `LlamaCpp`: llama.cpp's defaults as vendored in llama-cpp-python 0.3.36 (sdist
  llama_cpp_python-0.3.36.tar.gz, vendor/llama.cpp): common/common.h `common_params_speculative_draft`
  n_max = 3, n_min = 0, p_min = 0.0 for every drafter with a model (draft model, EAGLE-3, MTP, DFlash);
  common/speculative.cpp (draft-simple loop): the draft stops before a token whose top probability is
  < p_min, a draft shorter than n_min is dropped. A copying drafter (ngram-map, `size_m` = 48 there)
  offers its whole copy: here, everything the trace recorded (≤ 31).
- `HFHeuristic`: transformers' `num_assistant_tokens_schedule="heuristic"`
  (src/transformers/generation/candidate_generator.py, `update_candidate_strategy`, huggingface/
  transformers@00a11b6a0745b442473aef0221e098d022b8158c): +2 when every candidate was accepted, else
  −1 (at least 1), kept across generate() calls; starts at `num_assistant_tokens` = 20 (GenerationConfig
  default). Its assistant also stops drafting below `assistant_confidence_threshold` (0.4 by default);
  that threshold's ROC re-fit (sklearn) is left out. Transformers applies the schedule to draft
  models only; here every drafter gets it.
- `IkAutotune`: ik_llama.cpp `--spec-autotune` (PR #1595; common/spec-tuner.cpp and spec-tuner.h,
  ikawrakow/ik_llama.cpp@1b870604b511b951a7e9cb620b500576c13dc1fe): an ε-greedy bandit (ε = 0.15) per
  parameter, a fresh arm drawn for every draft call, reward = that step's tokens per second,
  incremental-mean arm values; n_max arms 1..max(16, n_max); a draft model also p_min (0..0.95, 11
  points) and n_min (0..6), an n-gram drafter n_min (0..min(4, n_max − 1)), MTP (and here heads) n_max
  only; every arm starts at index 0; after 30 consecutive steps below 0.7× the steps' EMA (α 0.05)
  every score resets, then 50 steps of cooldown. The user n_max is taken as 16.
- `BeeProfit`: BeeLlama's `profit` adaptive draft-max controller (tools/server/server-adaptive-dm.h,
  Anbeeld/beellama.cpp@10acb484be956d3362669b28cc2fd71c985f3239): EWMAs (α 0.15) of each position's
  survival (accepted ≥ pos + 1 when drafted that far) and of each depth's cycle time; score(n) =
  (1 + Σ survival) / cycle_ms(n), an unmeasured depth extrapolated from the nearest measured one
  (n × its draft ms per token + its verify ms); nothing before 3 no-draft cycles (the baseline), then
  the full depth until a depth has 3 samples; the best candidate must beat the baseline by 5%, else
  after 8 such decisions it turns off; up by ≤ 2 steps and down by 1 step, each only when the best
  scores ≥ 5% over the current; a no-draft cycle every 128 cycles refreshes the baseline. How the
  server wakes an off controller is in server-context.cpp, not read: here, as its defaults
  (dm_probe_interval 16, dm_probe_fraction 0.25) say, a probe of max(2, 0.25 × depth) tokens every
  16 off cycles. Its depth ceiling here: 15 (31 for a free drafter).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

COPYING = ("ngram", "history")  # drafters that copy: no confidences, microseconds a draft


class Controller:
    """A draft-length policy: `ask` → tokens to draft, `keep` → (computed, verified), `feedback`."""

    name = "controller"

    def start(self) -> None:
        """A new request (task)."""

    def ask(self, limit: int) -> int:
        raise NotImplementedError

    def keep(self, confidence: Sequence[float] | None, n: int) -> tuple[int, int]:
        """Of an n-token draft (its confidences, if any): (tokens computed, tokens verified)."""
        return n, n

    def feedback(self, drafted: int, accepted: int, ms: float, draft_ms: float = 0.0) -> None:
        """The cycle verified `drafted` tokens, `accepted` of them, in ms (`draft_ms` of it drafting)."""


class Fixed(Controller):
    def __init__(self, gamma: int) -> None:
        self.gamma, self.name = gamma, f"k={gamma}"

    def ask(self, limit: int) -> int:
        return self.gamma


def _p_min_cut(confidence: Sequence[float] | None, n: int, p_min: float) -> int:
    """Tokens drafted before the first whose confidence is < p_min."""
    if confidence is None or p_min <= 0:
        return n
    return next((i for i, c in enumerate(confidence[:n]) if c < p_min), n)


class LlamaCpp(Controller):
    name = "llama.cpp"

    def __init__(self, kind: str, n_max: int = 3, n_min: int = 0, p_min: float = 0.0) -> None:
        self.copying = kind in COPYING
        self.n_max, self.n_min, self.p_min = n_max, n_min, p_min

    def ask(self, limit: int) -> int:
        return limit if self.copying else self.n_max

    def keep(self, confidence: Sequence[float] | None, n: int) -> tuple[int, int]:
        k = _p_min_cut(confidence, n, self.p_min)
        return k, (k if k >= self.n_min else 0)


class HFHeuristic(Controller):
    name = "hf-heuristic"

    def __init__(self, start: int = 20, threshold: float = 0.4) -> None:
        self.k, self.threshold = start, threshold

    def ask(self, limit: int) -> int:
        return self.k

    def keep(self, confidence: Sequence[float] | None, n: int) -> tuple[int, int]:
        k = _p_min_cut(confidence, n, self.threshold)
        return k, k

    def feedback(self, drafted: int, accepted: int, ms: float, draft_ms: float = 0.0) -> None:
        if drafted:
            self.k = self.k + 2 if accepted == drafted else max(1, self.k - 1)


class _Coord:
    """One tuned parameter: arms (values) with incremental-mean rewards."""

    def __init__(self, values: Sequence[float]) -> None:
        self.values = list(values)
        self.q, self.n = [0.0] * len(values), [0] * len(values)
        self.current = self.best = 0

    def update(self, reward: float) -> None:
        i = self.current
        self.n[i] += 1
        self.q[i] += (reward - self.q[i]) / self.n[i]
        seen = [j for j in range(len(self.values)) if self.n[j]]
        self.best = max(seen, key=lambda j: self.q[j])  # first of equals, as a strict > scan

    def reset(self) -> None:
        self.q, self.n = [0.0] * len(self.values), [0] * len(self.values)
        self.current = self.best = 0  # the user's arm in the source; 0 here: every arm starts at 0


class IkAutotune(Controller):
    name = "ik-autotune"
    EPSILON, EMA_ALPHA, DROP, RESET_AFTER, COOLDOWN = 0.15, 0.05, 0.30, 30, 50

    def __init__(self, kind: str, n_max: int = 16, seed: int = 0) -> None:
        self.coords = {"n_max": _Coord(range(1, max(16, n_max) + 1))}
        if kind in ("model", "assistant"):
            self.coords["p_min"] = _Coord([0.95 * i / 10 for i in range(11)])
            self.coords["n_min"] = _Coord(range(7))
        elif kind in COPYING:
            self.coords["n_min"] = _Coord(range(max(0, min(4, n_max - 1)) + 1))
        self.rng = np.random.default_rng(seed)
        self.ema, self.low, self.cooldown = 0.0, 0, 0
        self._n_min, self._p_min = 0, 0.0

    def ask(self, limit: int) -> int:
        for c in self.coords.values():
            c.current = int(self.rng.integers(len(c.values))) if self.rng.random() < self.EPSILON else c.best
        value = {k: c.values[c.current] for k, c in self.coords.items()}
        n_max = max(1, int(value["n_max"]))
        self._n_min = min(int(value.get("n_min", 0)), n_max)
        self._p_min = min(0.95, float(value.get("p_min", 0.0)))
        return n_max

    def keep(self, confidence: Sequence[float] | None, n: int) -> tuple[int, int]:
        k = _p_min_cut(confidence, n, self._p_min)
        return k, (k if k >= self._n_min else 0)

    def feedback(self, drafted: int, accepted: int, ms: float, draft_ms: float = 0.0) -> None:
        tps = (accepted + 1) * 1000.0 / ms
        for c in self.coords.values():
            c.update(tps)
        if self.cooldown > 0 or self.ema <= 0:
            self.cooldown = max(0, self.cooldown - 1)
        elif tps < self.ema * (1 - self.DROP):
            self.low += 1
            if self.low >= self.RESET_AFTER:  # a task change: explore again
                for c in self.coords.values():
                    c.reset()
                self.low, self.cooldown, self.ema = 0, self.COOLDOWN, 0.0
                return
        else:
            self.low = 0
        self.ema = tps if self.ema <= 0 else self.ema + self.EMA_ALPHA * (tps - self.ema)


class _Ewma:
    def __init__(self) -> None:
        self.value, self.n = 0.0, 0

    def add(self, x: float, alpha: float) -> None:
        self.value = x if self.n == 0 else self.value + alpha * (x - self.value)
        self.n += 1


class BeeProfit(Controller):
    name = "bee-profit"
    ALPHA, MIN_SAMPLES, PROFIT_MIN, RAISE, LOWER = 0.15, 3, 0.05, 0.05, 0.05
    OFF_DWELL, PROBE_INTERVAL, PROBE_FRACTION, BASELINE_INTERVAL = 8, 16, 0.25, 128

    def __init__(self, depth: int) -> None:
        self.base = depth
        self.survival = [_Ewma() for _ in range(depth)]  # [pos]: accepted ≥ pos + 1, when drafted that far
        self.cycle = [_Ewma() for _ in range(depth + 1)]  # [0]: the no-draft baseline
        self.draft_ms = [_Ewma() for _ in range(depth + 1)]
        self.verify_ms = [_Ewma() for _ in range(depth + 1)]
        self.n = -1
        self.below = self.off_cycles = self.since_baseline = 0
        self.resume = -1  # the depth to come back to after a baseline probe
        self.off = False

    def start(self) -> None:  # reset_request_state: what was learned stays
        self.n, self.below, self.off_cycles, self.since_baseline, self.resume = -1, 0, 0, 0, -1
        self.off = False

    def _ready(self, d: int) -> bool:
        return self.cycle[d].n >= self.MIN_SAMPLES and self.cycle[d].value > 0

    def _scores(self) -> dict[int, float]:
        """{depth: (1 + E[accepted]) per ms of its cycle} for the depths known enough (0: the
        baseline); an unmeasured depth is extrapolated from the nearest measured one."""
        scores = {0: 1.0 / self.cycle[0].value}
        ready = [d for d in range(1, self.base + 1) if self._ready(d)]
        expected = 0.0
        for n in range(1, self.base + 1):
            if self.survival[n - 1].n < self.MIN_SAMPLES:
                break  # E[accepted] at depth ≥ n is not known
            expected += min(1.0, max(0.0, self.survival[n - 1].value))
            if self._ready(n):
                ms = self.cycle[n].value
            elif ready:
                ref = min(ready, key=lambda d: abs(d - n))
                ms = n * self.draft_ms[ref].value / ref + self.verify_ms[ref].value
            else:
                continue
            if ms > 0:
                scores[n] = (1.0 + expected) / ms
        return scores

    def _decide(self) -> int:
        if not self._ready(0):
            return 0
        if not any(self._ready(d) for d in range(1, self.base + 1)):
            return self.base
        current = max(0, min(self.resume if self.resume > 0 else self.n, self.base))
        scores = self._scores()
        self.resume = -1
        best = max(scores, key=lambda n: (scores[n], -n))  # the first of equal scores
        if best == 0 or scores[best] < scores[0] * (1 + self.PROFIT_MIN):
            self.below += 1
            return 0 if self.below >= self.OFF_DWELL else current
        self.below = 0
        cur = scores.get(current, 0.0) if current > 0 else 0.0
        if best > current:
            return current if cur > 0 and scores[best] < cur * (1 + self.RAISE) else min(best, current + 2)
        if best < current:
            return current if cur > 0 and scores[best] < cur * (1 + self.LOWER) else current - 1
        return current

    def ask(self, limit: int) -> int:
        if self.off:  # switched off: a probe every PROBE_INTERVAL cycles, then decide again
            self.off_cycles += 1
            if self.off_cycles % self.PROBE_INTERVAL:
                return 0
            self.off, self.n = False, min(self.base, max(2, int(self.base * self.PROBE_FRACTION)))
            return self.n
        if self.n > 0 and self.since_baseline >= self.BASELINE_INTERVAL:  # refresh the baseline
            self.resume, self.since_baseline = self.n, 0
            return 0
        self.n = self._decide()
        if self.n == 0 and self.below >= self.OFF_DWELL:
            self.off, self.off_cycles = True, 0
        return self.n

    def feedback(self, drafted: int, accepted: int, ms: float, draft_ms: float = 0.0) -> None:
        for i in range(min(drafted, self.base)):
            self.survival[i].add(float(accepted > i), self.ALPHA)
        d = min(drafted, self.base)
        self.cycle[d].add(ms, self.ALPHA)
        self.verify_ms[d].add(ms - draft_ms, self.ALPHA)
        self.draft_ms[d].add(draft_ms, self.ALPHA)
        if d and self._ready(0):
            self.since_baseline += 1
