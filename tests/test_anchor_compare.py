"""bench/anchors/compare.py's paired table (rows of `native.py --edgespec-auto`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("anchor_compare", Path(__file__).parents[1] / "bench/anchors/compare.py")
compare = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(compare)


def _rows(task: str, cat: str, rep: int, speeds: dict) -> list[dict]:
    return [dict(task=task, category=cat, repeat=rep, n_max=n, tok_per_s=v) for n, v in speeds.items()]


def test_paired_ratios_are_taken_within_each_task_and_repeat(capsys: pytest.CaptureFixture[str]):
    rows = (_rows("a-1", "a", 0, {0: 100.0, 4: 120.0, 8: 150.0, "auto": 165.0})  # best n-max 8: 1.10
            + _rows("a-1", "a", 1, {0: 50.0, 4: 60.0, 8: 75.0, "auto": 82.5})  # a slow machine minute: same ratios
            + _rows("b-1", "b", 0, {0: 100.0, 4: 90.0, 8: 80.0, "auto": 99.0})  # best n-max 4: 1.10
            + _rows("b-2", "b", 0, {0: 100.0, 4: 100.0, 8: 70.0}))  # no edgespec run: left out
    compare.paired({"meta": {"n_max": [0, 4, 8]}, "rows": rows})
    lines = {ln.split(" | ")[0].strip("| "): ln.strip("| ").split(" | ") for ln in capsys.readouterr().out.splitlines()}
    assert lines["category"][-1] == "auto ÷ best n-max of each pair"
    a, b, everything = lines["a"], lines["b"], lines["all"]
    assert a[1] == "2" and a[-3:] == ["1.38", "1.10", "**1.10**"]  # auto ÷ n-max 4, ÷ n-max 8, ÷ best
    assert b[1] == "1" and b[-1] == "**1.10**" and b[3] == "100.0"
    assert everything[1] == "3" and everything[-1] == "**1.10**"


def test_paired_without_edgespec_rows_says_so():
    with pytest.raises(SystemExit, match="--edgespec-auto"):
        compare.paired({"meta": {"n_max": [0, 4]}, "rows": _rows("a-1", "a", 0, {0: 1.0, 4: 2.0})})
