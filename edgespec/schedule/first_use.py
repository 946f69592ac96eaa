"""A target's first use: no timing before its first reply.

A target whose cost profile is not cached on this machine (`needs_learning`: T(k) or the context term
missing) decodes its first `-k auto` reply plainly, at plain speed, and that reply's steps are timed
as they run anyway (`StepLog`: T(1) at each context length, so T(1) and what each cached token adds).
What is still missing (the exact verification batch, T(k) for k > 1, a drafter's prior) is timed
while the engine is idle, after the reply (Engine: a background run holding the engine, which the
next generation, `cancel` or `close` stops within one forward: `Interruptible`). Each part is cached
as soon as it is measured, so a run cut short resumes where it stopped. Speculation starts with the
first generation after the profile is complete; the exact-batch check still comes before any
speculative cycle (Engine.stream). A cached profile changes nothing: priced as before.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from edgespec.backends.base import Backend
from edgespec.calibration import CALIBRATION_KS, CONTEXT_TOKENS, load_profile, profile_path, save_profile

MIN_STEPS = 8  # plain steps a reply needs before its T(1) is kept
MIN_SPREAD = 64  # context lengths (tokens) the steps must span before their slope is kept as the context term
BINS = 8  # the steps' context range is cut into this many bins; the slope is fitted through their medians
# tokens per forward when idle work reads tokens without logits (timing, putting the conversation
# back): a stop or a close is honoured within one such forward
SPLIT = 32


def needs_learning(backend: Backend) -> bool:
    """Whether `backend`'s cost profile lacks what pricing would time (T(k) for every calibrated k, the
    context term): its first auto reply then decodes plainly and learns. False for an in-memory model
    (nothing is cached for it, and timing it costs milliseconds: priced at first use as before)."""
    path = profile_path(backend)
    if path is None:
        return False
    prof = load_profile(path)
    return prof is None or prof.context_ms is None or any(k not in prof.t_forward_ms for k in CALIBRATION_KS)


class StepLog:
    """The plain steps of an unprofiled target's first reply: (cached tokens, ms) of each."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, float]] = []

    def add(self, context: int, seconds: float) -> None:
        self.steps.append((context, seconds * 1000))

    def fold(self, backend: Backend) -> None:
        """Keep what the steps measured in the profile, where it lacks it: the context term (the
        slope of step time over context, when the steps span MIN_SPREAD tokens) and T(1) after
        CONTEXT_TOKENS cached tokens (each step moved there by the context term: the median). The
        idle timing's T(k) is then scaled to this T(1) (calibration.calibrate's anchor)."""
        if len(self.steps) < MIN_STEPS:
            return
        path = profile_path(backend)
        prof = load_profile(path)
        fields: dict = {}
        ctx_ms = prof.context_ms if prof is not None else None
        if ctx_ms is None and (ctx_ms := self.slope()) is not None:
            fields["context_ms"] = ctx_ms
        have = dict(prof.t_forward_ms) if prof is not None else {}
        if 1 not in have:
            c0 = CONTEXT_TOKENS
            have[1] = statistics.median(ms - (ctx_ms or 0.0) * (c - c0) for c, ms in self.steps)
            fields["t_forward_ms"] = have
        if fields:
            save_profile(path, backend, **fields)

    def slope(self) -> float | None:
        """ms a step pays per cached token (≥ 0), fitted through the medians of BINS context bins
        (a slow step moves nothing); None when the contexts span under MIN_SPREAD tokens."""
        ctx = np.array([c for c, _ in self.steps], dtype=float)
        ms = np.array([t for _, t in self.steps])
        if ctx.max() - ctx.min() < MIN_SPREAD:
            return None
        edges = np.linspace(ctx.min(), ctx.max() + 1, BINS + 1)
        pts = [(float(np.median(ctx[m])), float(np.median(ms[m])))
               for lo, hi in zip(edges, edges[1:]) if (m := (ctx >= lo) & (ctx < hi)).any()]
        if len(pts) < 3:
            return None
        x, y = np.array(pts).T
        return max(0.0, float(np.polyfit(x, y, 1)[0]))


class Interrupted(Exception):
    """An idle timing run was stopped (a generation wants the engine, or it is closing)."""


class Interruptible:
    """`backend` as calibration sees it during an idle run: every forward first checks `stop`
    (raising Interrupted), and a read without logits goes in forwards of SPLIT tokens, so a stop is
    honoured within one short forward. Everything else is the backend's own."""

    def __init__(self, backend: Backend, stop: threading.Event) -> None:
        self._backend, self._stop = backend, stop

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    def _check(self) -> None:
        if self._stop.is_set():
            raise Interrupted

    def eval(self, tokens: Sequence[int], rows: str = "last") -> np.ndarray:
        if rows != "none":
            self._check()
            return self._backend.eval(tokens, rows=rows)
        out = None
        for i in range(0, len(tokens), SPLIT):
            self._check()
            out = self._backend.eval(tokens[i:i + SPLIT], rows="none")
        return out if out is not None else self._backend.eval(tokens, rows="none")

    def eval_argmax(self, tokens: Sequence[int]) -> np.ndarray:
        self._check()
        return self._backend.eval_argmax(tokens)


def time_idle(pricing: Any, drafter: Any, kv: list[int], stop: threading.Event, steps: StepLog | None,
              abandon: threading.Event) -> tuple[list[int], Exception | None]:
    """An idle timing run on an engine held for it: keep what a first reply's `steps` measured, time
    what is still missing (`pricing.calibrate`, stopped within one forward by `stop`), then put the
    conversation `kv` (the tokens in the target's cache) back, so the next turn reuses its prefix as
    if nothing had been timed, also when `stop` cut the timing short (the generation that stopped it
    waits for that read, which it would otherwise make itself). Only `abandon` (closing) skips it.
    Returns (the tokens now in the cache, the error a failed run met)."""
    target, error = pricing.target, None
    try:
        if steps is not None:
            steps.fold(target)
        pricing.calibrate(drafter, stop=stop)
    except Interrupted:
        pass
    except Exception as e:  # a backend fault: the caller reports it
        error = e
    try:  # timing used the cache (and one stopped left anything in it): always rebuilt
        target.truncate(0)
        kept: list[int] = []
        for i in range(0, len(kv), SPLIT):
            if abandon.is_set():
                break
            target.eval(kv[i:i + SPLIT], rows="none")
            kept.extend(kv[i:i + SPLIT])
        return kept, error
    except Exception as e:
        target.truncate(0)
        return [], error or e
