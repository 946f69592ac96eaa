"""A training run's learning curve: one CSV row per held-out evaluation, and a PNG of τ against the
training tokens seen (log x axis) when matplotlib (the ``plot`` extra) is installed, and ``project``:
where a log-linear fit of the first pass over the data reaches a goal τ (the data a goal needs).

Columns: ``step``, ``tokens`` (training tokens seen so far: the tokens of every training sequence read,
counted again each time it is read; the same count for every head kind, so curves of EAGLE-3 and
DFlash on one cache share their x axis), ``train_loss`` (mean step loss since the previous
evaluation), ``val_loss``, ``tau``, ``acc_1``..``acc_k`` (held-out chained acceptance by draft
position) and ``elapsed_s`` (training seconds over all sessions, evaluation excluded).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np


def curve_row(step: int, tokens: int, train_loss: float, ev: Mapping[str, Any], elapsed: float) -> dict[str, Any]:
    """One CSV row from ``Trainer.evaluate``'s result ``ev`` at ``step``."""
    acc = {f"acc_{k}": float(a) for k, a in enumerate(ev["acceptance"], start=1)}
    return {"step": step, "tokens": tokens, "train_loss": train_loss, "val_loss": float(ev["loss"]),
            "tau": float(ev["tau"]), **acc, "elapsed_s": elapsed}


def write_curve(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """Rewrite ``path`` with ``rows`` (atomic); no rows: remove it. A resumed run calls this with its
    checkpoint's rows, which drops rows a crashed session wrote after its last checkpoint."""
    path = Path(path)
    if not rows:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=_fields(rows), restval="")
        w.writeheader()
        w.writerows(rows)
    tmp.replace(path)


def append_curve(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """Append the last of ``rows`` (the run's history) to ``path``; rewrite the file from all of them
    when its header differs (a resume that changed the draft depth)."""
    path = Path(path)
    fields = _fields(rows)
    if path.exists():
        with path.open(newline="") as fh:
            header = next(csv.reader(fh), [])
        if header == fields:
            with path.open("a", newline="") as fh:
                csv.DictWriter(fh, fieldnames=fields, restval="").writerow(rows[-1])
            return
    write_curve(path, rows)


def read_curve(path: Path) -> list[dict[str, str]]:
    """The rows of a curve CSV as strings (empty when the file does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


class Projection(NamedTuple):
    """τ ≈ ``a + b·ln(tokens)`` fitted to a curve's rows; ``goal_tokens``: the training tokens at which
    the fit reaches the goal τ (None when it does not rise)."""

    a: float
    b: float
    goal: float
    goal_tokens: float | None
    rows: int


def project(rows: Sequence[Mapping[str, Any]], goal: float = 2.5, max_tokens: float | None = None,
            skip: int = 1) -> Projection | None:
    """Least-squares fit of τ against ln(training tokens) over the curve's rows with
    ``tokens <= max_tokens`` (a first pass over the data: every token new, so training tokens are data
    tokens), leaving out the first ``skip`` rows (the head's start), and where it reaches ``goal``.
    A log-linear extrapolation is a rough guide, not a promise: such curves bend over.

    Returns:
        None when fewer than 3 rows are left.
    """
    pts = [(float(r["tokens"]), float(r["tau"])) for r in rows
           if float(r["tokens"]) > 0 and (max_tokens is None or float(r["tokens"]) <= max_tokens)][skip:]
    if len(pts) < 3:
        return None
    x, y = np.log([p[0] for p in pts]), np.array([p[1] for p in pts])
    b, a = np.polyfit(x, y, 1)
    ln_at = (goal - a) / b if b > 1e-9 else math.inf  # a flat curve (b ≈ 0 up to rounding) never gets there
    return Projection(float(a), float(b), goal, math.exp(ln_at) if ln_at < 700 else None, len(pts))


def plot_curve(csv_path: Path, png_path: Path, fit: Projection | None = None) -> bool:
    """Draw τ against training tokens (log x axis) from ``csv_path`` into ``png_path``, with ``fit``
    (``project``) as a dashed line up to its goal.

    Returns:
        False, writing nothing, when matplotlib is not installed or no row has tokens > 0.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return False
    rows = [r for r in read_curve(csv_path) if int(r["tokens"]) > 0]
    if not rows:
        return False
    # Figure + Agg canvas, not pyplot: no global backend or figure state in a library call
    fig = Figure(figsize=(6, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot([int(r["tokens"]) for r in rows], [float(r["tau"]) for r in rows], marker=".", label="held-out τ")
    if fit is not None:
        x0 = float(rows[0]["tokens"])
        x1 = max(float(rows[-1]["tokens"]), fit.goal_tokens or 0.0)
        xs = np.geomspace(x0, x1, 50)
        ax.plot(xs, fit.a + fit.b * np.log(xs), "--", color="gray",
                label=f"fit {fit.a:.2f} + {fit.b:.3f}·ln(tokens)")
        ax.axhline(fit.goal, color="gray", linewidth=0.5)
        ax.legend(loc="upper left")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens seen")
    ax.set_ylabel("held-out τ (greedy, teacher-forced)")
    ax.set_title(Path(csv_path).stem)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    return True


def _fields(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Column names in first-seen order (acc_k columns are those of the deepest row)."""
    names: dict[str, None] = {}
    for r in rows:
        names.update(dict.fromkeys(r))
    acc = sorted((n for n in names if n.startswith("acc_")), key=lambda n: int(n[4:]))
    rest = [n for n in names if not n.startswith("acc_") and n != "elapsed_s"]
    return [*rest, *acc, "elapsed_s"]
