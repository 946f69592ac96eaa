"""What a cycle is expected to give: the rate the scheduler maximises over γ and the plan it reports.

    rate(γ) = E[tokens | γ] / (T_draft(γ) + T_verify(γ + 1) + E[rollback | γ]),  E[tokens | γ] = 1 + S₁ + … + S_γ

with S_i the chance that drafts 1..i are all accepted (edgespec.schedule.scheduler learns them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def best_gamma(survival: Sequence[float], t_draft: Sequence[float], t_verify: Sequence[float],
               t_rollback: Sequence[float] | None = None) -> tuple[int, float]:
    """argmax_γ of (1 + Σ_{i≤γ} S_i) / (t_draft[γ] + t_verify[γ+1] + E[rollback | γ]) for
    0 ≤ γ ≤ len(survival), and that rate in tokens per unit of time. t_draft[0] is a plain step's
    (0), t_verify[k] is T(k) (index 0 unused), t_rollback[n] the cost of keeping n of more drafts
    (None: free)."""
    best, best_rate, tokens = 0, -1.0, 1.0
    for g in range(len(survival) + 1):
        if g > 0:
            tokens += survival[g - 1]
        rate = tokens / (t_draft[g] + t_verify[g + 1] + expected_rollback(survival, g, t_rollback))
        if rate > best_rate:
            best, best_rate = g, rate
    return best, best_rate


def expected_rollback(survival: Sequence[float], gamma: int, t_rollback: Sequence[float] | None) -> float:
    """Σ_{n<γ} P(exactly n drafts accepted) · t_rollback[n], with P = S_n − S_{n+1} (S₀ = 1)."""
    if not t_rollback or gamma == 0:
        return 0.0
    s = [1.0, *survival[:gamma]]
    return sum((s[n] - s[n + 1]) * t_rollback[n] for n in range(gamma))


def cut(survival: Sequence[float], t_draft: Sequence[float], t_verify: Sequence[float], sunk: int,
        t_rollback: Sequence[float] | None = None) -> tuple[int, float]:
    """The best γ ≤ len(survival) once `sunk` tokens are drafted (drafting them is paid whatever γ
    is verified), and its expected tokens."""
    g, _ = best_gamma(survival, [t_draft[max(g, sunk)] for g in range(len(survival) + 1)], t_verify, t_rollback)
    return g, 1.0 + sum(survival[:g])



@dataclass
class Decision:
    """What one cycle was planned to give (for stats: predicted vs measured speed)."""

    gamma: int = 0
    tokens: float = 1.0  # expected tokens emitted
    ms: float = 0.0  # expected cost
    probe: bool = False
    seconds: float = 0.0  # time the decision itself took (plan + cut, not drafting)
    member: str | None = None  # a chain's member whose proposal is verified (drafters.chain)
    draft_ms: float = 0.0  # the part of `ms` spent drafting (sunk once the draft is made)
    tree: Any = None  # the draft tree to verify instead of the chain (schedule.trees; edgespec.tree.DraftTree)

    @property
    def rate(self) -> float:
        """Expected tokens per ms still to spend once the draft is made (verification, rollback)."""
        left = self.ms - self.draft_ms
        return self.tokens / left if left > 0 else 0.0
