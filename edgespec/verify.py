"""Verification of a draft against the target's logits. Pure numpy.

Notation: p = target distribution, q = draft distribution, x̃₁..x̃γ the draft.
Row i of `logits` is the target's next-token logits after the context and x̃₁..x̃ᵢ, so there
are γ+1 rows. Each function returns (n_accepted, next_token): the emitted tokens are
x̃₁..x̃ₙ followed by next_token (the correction at the first rejection, or the bonus token).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from edgespec.sampling import Dist, SamplingParams, process_rows, sample


def verify_greedy(logits: npt.NDArray[np.floating], draft: Sequence[int]) -> tuple[int, int]:
    """Accept x̃ᵢ while it equals the target's argmax; emit the argmax where they differ."""
    # row by row, so a rejection at row i reads i + 1 rows; one 2-D argmax reads all γ+1 and is
    # no faster when all pass (one memory-bound pass over the rows either way)
    return accept_greedy((int(np.argmax(row)) for row in logits), draft)


def accept_greedy(argmax: Iterable[int], draft: Sequence[int]) -> tuple[int, int]:
    """`verify_greedy` from the rows' argmax ids (γ+1 of them; read up to the first mismatch), as
    `Backend.eval_argmax` returns them."""
    for i, t in enumerate(argmax):
        if i == len(draft) or t != draft[i]:
            return i, int(t)
    raise ValueError(f"greedy verification of {len(draft)} drafts needs {len(draft) + 1} rows")


def verify_stochastic(
    logits: npt.NDArray[np.floating],  # (γ+1, V) target logits
    draft: Sequence[int],  # γ draft tokens
    q: npt.NDArray[np.float64] | None,  # (γ, V) processed draft probabilities; None = one-hot
    params: SamplingParams,
    rng: np.random.Generator,
    rows: list[Dist] | None = None,
) -> tuple[int, int]:
    """Rejection sampling: accept x̃ᵢ with probability min(1, pᵢ(x̃ᵢ)/qᵢ(x̃ᵢ)); at the first
    rejection sample from norm(max(0, pᵢ − qᵢ)); if all are accepted, sample the bonus from p_γ.
    A one-hot q (deterministic drafter) accepts with probability pᵢ(x̃ᵢ) and on rejection samples
    from pᵢ with x̃ᵢ zeroed. The emitted tokens are distributed exactly as sampling from p.
    The γ+1 rows are processed together (process_rows), each row's kept set only up to the first
    rejection. `rows`, when given, receives them: one p row per emitted token (the scheduler
    scores shadow drafts with them)."""
    p_rows = process_rows(logits[: len(draft) + 1], params)  # γ+1 distributions, built on access
    for i, x in enumerate(draft):
        p = p_rows[i]
        if rows is not None:
            rows.append(p)
        q_x = 1.0 if q is None else float(q[i, x])
        if q_x > 0.0 and rng.random() * q_x < p[x]:
            continue
        if q is None:
            return i, p.sample(rng, exclude=x)
        residual = np.maximum(p.dense() - q[i], 0.0)
        if residual.sum() <= 0.0:  # p == q up to rounding: the rejection had probability ~0
            return i, p.sample(rng)
        return i, sample(residual, rng)
    p = p_rows[len(draft)]
    if rows is not None:
        rows.append(p)
    return len(draft), p.sample(rng)


def verify(
    logits: npt.NDArray[np.floating],
    draft: Sequence[int],
    q: npt.NDArray[np.float64] | None,
    params: SamplingParams,
    rng: np.random.Generator,
    rows: list[Dist] | None = None,
) -> tuple[int, int]:
    """Greedy or stochastic verification, by `params` (`rows`: see verify_stochastic; greedy
    leaves it empty)."""
    if params.greedy:
        return verify_greedy(logits, draft)
    return verify_stochastic(logits, draft, q, params, rng, rows)
