"""Bench analysis of cost profiles: the ideal speedup that measured cycles allow at zero runtime
overhead, and E[τ(γ)] re-estimated at smaller γ.

ideal speedup(γ) = E[τ(γ)] · T(1) / (T_draft(γ) + T(γ+1))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def ideal_speedup_at(t_forward_ms: dict[int, float], t_draft: Callable[[int], float],
                     cycles: Sequence[tuple[int, int]], gamma: int | None = None) -> float | None:
    """The speedup of these very cycles (drafted, accepted) at zero runtime overhead:
    Σ tokens · T(1) / Σ (T_draft(d) + T(d+1)). With `gamma`, each cycle recorded at a larger γ is
    truncated to d = min(drafted, γ): a deterministic drafter's first γ tokens are the same at any
    γ, and one that proposes fewer (n-gram without a match) pays only the shorter verification.
    None when T(d+1) was not measured or there are no cycles."""
    ds = [(d if gamma is None else min(d, gamma), n) for d, n in cycles]
    if not ds or any(d + 1 not in t_forward_ms for d, _ in ds):
        return None
    tokens = sum(min(n, d) + 1 for d, n in ds)
    cost = sum(t_draft(d) + t_forward_ms[d + 1] for d, _ in ds)
    return tokens * t_forward_ms[1] / cost


def expected_tau(accepted: Sequence[int], drafted: Sequence[int], gamma: int) -> float:
    """E[τ(γ)] estimated from cycles of a run at a larger γ: a deterministic drafter's first γ
    tokens are the same at any γ ≥ them, so a cycle that drafted L and had n accepted would have
    emitted min(n, γ, L) + 1 tokens at γ. `accepted`/`drafted`: one entry per cycle."""
    if not accepted:
        return 1.0
    return sum(min(n, gamma, d) + 1 for n, d in zip(accepted, drafted)) / len(accepted)
