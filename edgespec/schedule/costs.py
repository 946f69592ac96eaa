"""The scheduler's cost model: T_verify(k) for the target, T_draft(γ) = fixed + γ·per_token for the
drafter (fixed > 0: a block drafter, one forward for all rows), both following the cycles timed.

Verification grows with the context: every verified token attends to every cached one, and a batch
does not share that work (llama.cpp's CPU flash attention), so T(k, c) = T(k) + k·ctx_ms·(c − c₀),
with T(k) the time after c₀ cached tokens (the profile's context). On SmolLM2 here ctx_ms is about
5 µs: after 1000 tokens T(16) is ~11·T(1) instead of 8.

A recurrent target pays for a partial acceptance once more: keeping n of γ drafts restores its
checkpoint and re-evaluates n + 1 tokens, T_rollback(n) = restore + T(n + 1) (restore learned from
the rollbacks timed; 0 before the first)."""

from __future__ import annotations

import statistics
from collections import deque

import numpy as np

from edgespec.drafters.base import DraftCost

K_MAX = 32  # most tokens one verification pass checks (γ ≤ K_MAX − 1)
FIT_WEIGHT_CAP = 8  # a draft length's weight in the fit grows with its samples up to this many


def token_sums(acceptance: float | np.ndarray, longest: int) -> np.ndarray:
    """[..., γ] = 1 + a + … + a^γ for γ = 0..longest: the tokens a cycle of γ drafts yields when each
    is accepted with probability a (elementwise for an array)."""
    a = np.asarray(acceptance, dtype=float)[..., None]
    return np.cumsum(a ** np.arange(longest + 1), axis=-1)


class RobustTime:
    """An EMA of running medians: one slow outlier moves nothing, a lasting shift moves it within a
    few samples. With a `prior` (> 0) the EMA starts from it, so the first sample is no more trusted
    than the next ones (a first draft after a prompt often pays a one-off set-up); without one the
    first sample is the value."""

    def __init__(self, window: int = 5, beta: float = 0.3, prior: float = 0.0) -> None:
        self.samples: deque[float] = deque(maxlen=window)
        self.beta, self.value, self.n = beta, prior, 0

    def add(self, x: float) -> None:
        self.samples.append(x)
        m = statistics.median(self.samples)
        self.value = m if self.n == 0 and self.value <= 0 else self.value + self.beta * (m - self.value)
        self.n += 1


class CostModel:
    """T_verify(k) for k = 1..K_MAX and T_draft(γ) for γ < K_MAX, in ms.

    Measured k follow their own timings; unmeasured ones are the prior (profile) times a shared
    scale, the robust mean ratio of measured to prior, so a machine that slows down slows them all.
    Drafts are timed per length γ (a robust value each) and T_draft(γ) = fixed + γ·per_token is a
    weighted least-squares line through them (one length seen: the prior, scaled to it). They are
    kept in the profile's units (÷ that scale when timed, × it when asked), so a drafter timed while
    something else slowed the machine is not judged too dear once it recovers.

    Timings are kept as if taken after `base_context` cached tokens (the context term is taken off
    each observation and put back for the context asked about).

    Args:
        t_forward_ms: the target's profile, {k: ms of a k-token forward after base_context tokens}.
        draft_per_token_ms, draft_fixed_ms: the drafter's prior (DraftCost).
        block: the drafter computes every row of a block before any confidence is known, so a
            confidence cut saves verification only, never drafting.
        ctx_ms: ms each verified token pays per cached token beyond base_context (0: none).
        recurrent: the target rolls back by checkpoint and re-evaluation (`t_rollback`).
        catch_up_ms: a draft model's measured ms per context token it reads in a batch (its prompt,
            tokens another drafter proposed); None: a quarter of a drafted token until one is seen.
        copy_ms: ms per context token to take the target's whole cache instead of reading what it
            missed (a KV handoff; None: it cannot).
    """

    def __init__(self, t_forward_ms: dict[int, float], draft_per_token_ms: float = 0.0,
                 draft_fixed_ms: float = 0.0, block: bool = False, ctx_ms: float = 0.0,
                 base_context: int = 64, recurrent: bool = False, catch_up_ms: float | None = None,
                 copy_ms: float | None = None) -> None:
        ks = sorted(t_forward_ms)
        self.prior = [0.0] + [float(np.interp(k, ks, [t_forward_ms[j] for j in ks])) if k <= ks[-1]
                              else t_forward_ms[ks[-1]] * k / ks[-1] for k in range(1, K_MAX + 1)]
        self.verify = [RobustTime() for _ in range(K_MAX + 1)]
        self.scale = RobustTime(window=9, beta=0.2)
        self.draft_prior = DraftCost(draft_fixed_ms, draft_per_token_ms, block, catch_up_ms=catch_up_ms,
                                     copy_ms=copy_ms)
        # [γ]: ms of drafting γ tokens, each starting from the prior's line (a measured prior is not
        # thrown away on one draft's timing)
        self.draft_at = [RobustTime(prior=draft_fixed_ms + g * draft_per_token_ms if g else 0.0) for g in range(K_MAX)]
        self.catch_up = RobustTime()  # a draft model's ms per context token when it catches up
        self.ctx_ms, self.base_context = ctx_ms, base_context
        self.recurrent = recurrent
        self.restore = RobustTime()  # a rollback's ms beyond re-evaluating the kept tokens
        self._verify: list[float] | None = None
        self._verify_at: tuple[int, list[float]] = (-1, [])  # t_verify at the latest context asked
        self._draft = self._line(draft_fixed_ms, draft_per_token_ms)

    @property
    def block(self) -> bool:
        return self.draft_prior.block

    @property
    def free(self) -> bool:
        """The drafter did not price itself (a lookup: n-gram, history; what it costs is
        microseconds). The scheduler lets such a drafter draft in shadow at plain steps and verify
        up to K_MAX − 1 tokens a cycle; one that prices itself, however cheap, is costly (a shadow
        draft of K_MAX − 1 tokens every plain step would cost it that many tokens' drafting)."""
        return not (self.draft_prior.per_token_ms or self.draft_prior.fixed_ms)

    @classmethod
    def for_drafter(cls, t_forward_ms: dict[int, float], prior: DraftCost | None, **context) -> CostModel:
        """A cost model with the drafter's measured prior (None: free, like an n-gram drafter);
        `context`: ctx_ms and base_context."""
        if prior is None:
            return cls(t_forward_ms, **context)
        return cls(t_forward_ms, prior.per_token_ms, prior.fixed_ms, prior.block, catch_up_ms=prior.catch_up_ms,
                   copy_ms=prior.copy_ms, **context)

    def observe_verify(self, k: int, ms: float, context: int | None = None) -> None:
        """A k-token verification took ms after `context` cached tokens (None: base_context)."""
        ms = max(ms - self._attention(k, context), 0.05 * ms)
        self.verify[k].add(ms)
        self.scale.add(ms / self.prior[k])
        self._verify = None

    def observe_rollback(self, kept: int, ms: float, context: int | None = None) -> None:
        """Rolling a recurrent target back to `kept` accepted drafts took ms (restore + re-evaluating
        kept + 1 tokens) after `context` cached tokens."""
        self.restore.add(ms - self.t_verify(context)[kept + 1])

    def t_rollback(self, context: int | None = None) -> list[float] | None:
        """[n] = expected ms to roll back when n drafts are accepted and a later one is not (None: a
        KV cache, whose cut costs nothing worth pricing)."""
        if not self.recurrent:
            return None
        t_verify, restore = self.t_verify(context), self.restore.value
        return [max(0.0, restore + t_verify[n + 1]) for n in range(K_MAX)]

    def observe_draft(self, n_tokens: int, ms: float, synced: int = 0, copied: int = 0) -> None:
        """A draft of n_tokens (a block drafter: rows computed) took ms, of which catching up on
        `synced` context tokens, or taking `copied` from the target's cache instead (not learned from:
        a copy of a few ms drowns in a draft's own noise; the cost timed when the handoff opened
        stands). Kept in the profile's units (÷ `speed`)."""
        ms /= self.speed
        if copied:
            return
        if synced > 1:
            self.catch_up.add(max(0.0, ms - self._draft[n_tokens]) / synced)
        else:
            self.draft_at[n_tokens].add(ms)
            self._draft = self._line(*self.draft_fit())

    def draft_fit(self) -> tuple[float, float]:
        """(fixed ms, ms per token) of the draft times measured so far."""
        pts = [(g, t.value, min(t.n, FIT_WEIGHT_CAP)) for g, t in enumerate(self.draft_at) if t.n]
        fixed, per_token = self.draft_prior.fixed_ms, self.draft_prior.per_token_ms
        if not pts:
            return fixed, per_token
        if len({g for g, _, _ in pts}) == 1:  # one length: the prior's shape, scaled to its time
            g, ms, _ = pts[0]
            prior = fixed + g * per_token
            return (fixed * ms / prior, per_token * ms / prior) if prior > 0 else (0.0, ms / g)
        w = sum(n for _, _, n in pts)
        g_mean = sum(n * g for g, _, n in pts) / w
        t_mean = sum(n * t for _, t, n in pts) / w
        sxx = sum(n * (g - g_mean) ** 2 for g, _, n in pts)
        slope = sum(n * (g - g_mean) * (t - t_mean) for g, t, n in pts) / sxx
        if slope < 0:  # noise on a flat block cost: no per-token part
            return t_mean, 0.0
        if t_mean - slope * g_mean < 0:  # noise on a chain cost: no fixed part
            return 0.0, sum(n * g * t for g, t, n in pts) / sum(n * g * g for g, _, n in pts)
        return t_mean - slope * g_mean, slope

    @property
    def speed(self) -> float:
        """How much slower than its profile the machine runs now (the target's measured ÷ profiled
        T(k), robust). Drafts are timed in these units, so a slow moment that slowed the drafter too
        is not held against it once the machine recovers (a drafter judged too dear is seldom timed
        again)."""
        return self.scale.value if self.scale.n else 1.0

    def t_catch_up(self, n: int, context: int | None = None) -> float:
        """ms for a draft model to evaluate n context tokens it missed (a batch: cheaper per token,
        never dearer than a drafted token: a fresh context's first forward also pays its set-up).
        Before any is seen: the read cost measured at load, else a quarter of a drafted token. One
        that can take the target's cache instead pays the cheaper: reading n or copying `context`."""
        per_token = self._draft[2] - self._draft[1]
        prior = self.draft_prior.catch_up_ms
        if self.catch_up.n:
            read = n * min(self.catch_up.value, per_token)
        else:
            read = n * (min(prior, per_token) if prior is not None else per_token / 4)
        copy = self.draft_prior.copy_ms
        if copy is not None and n > 1:
            read = min(read, (n if context is None else max(n, context)) * copy)
        return read * self.speed

    def t_verify(self, context: int | None = None) -> list[float]:
        """[k] = expected ms of a k-token verification after `context` cached tokens (None:
        base_context; index 0 unused)."""
        if self._verify is None:
            speed = self.speed
            self._verify = [v.value if v.n else p * speed for v, p in zip(self.verify, self.prior)]
            self._verify_at = (-1, self._verify)
        if not self.ctx_ms or context is None or context <= self.base_context:
            return self._verify
        if self._verify_at[0] != context:  # asked several times a cycle: kept for the latest context
            c, d = self.ctx_ms, context - self.base_context
            self._verify_at = (context, [t + k * c * d for k, t in enumerate(self._verify)])
        return self._verify_at[1]

    def _attention(self, k: int, context: int | None) -> float:
        return 0.0 if context is None else k * self.ctx_ms * max(0, context - self.base_context)

    def t_draft(self) -> list[float]:
        """[γ] = expected ms to draft γ tokens (0 for γ = 0), at the machine's current speed."""
        speed = self.speed
        return self._draft if speed == 1.0 else [t * speed for t in self._draft]

    def speedup(self, acceptance: float | np.ndarray, longest: int, sums: np.ndarray | None = None
                ) -> float | np.ndarray:
        """The speedup over plain steps these costs give a drafter whose every token is accepted with
        probability `acceptance` (elementwise for an array), at its best γ ≤ `longest` (`sums`: its
        token_sums up to at least `longest`, if already known)."""
        t_verify = self.t_verify()
        tokens = token_sums(acceptance, longest) if sums is None else sums[..., :longest + 1]
        ms = np.asarray(self.t_draft()[:longest + 1]) + np.asarray(t_verify[1:longest + 2])
        out = (tokens / ms).max(axis=-1) * t_verify[1]
        return float(out) if out.ndim == 0 else out

    @staticmethod
    def _line(fixed: float, per_token: float) -> list[float]:
        return [0.0] + [fixed + g * per_token for g in range(1, K_MAX)]
