"""A training run's learning curve: one CSV row per held-out evaluation, and a PNG of τ against the
training tokens seen (log x axis) when matplotlib (the ``plot`` extra) is installed.

Columns: ``step``, ``tokens`` (training tokens seen so far: the tokens of every training sequence read,
counted again each time it is read; the same count for every head kind, so curves of EAGLE-3 and
DFlash on one cache share their x axis), ``train_loss`` (mean step loss since the previous
evaluation), ``val_loss``, ``tau``, ``acc_1``..``acc_k`` (held-out chained acceptance by draft
position) and ``elapsed_s`` (training seconds over all sessions, evaluation excluded).
"""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


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


def plot_curve(csv_path: Path, png_path: Path) -> bool:
    """Draw τ against training tokens (log x axis) from ``csv_path`` into ``png_path``.

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
    ax.plot([int(r["tokens"]) for r in rows], [float(r["tau"]) for r in rows], marker=".")
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
