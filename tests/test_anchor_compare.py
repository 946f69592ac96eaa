"""edgespec.bench.anchor_compare's paired table (rows of `bench/anchors/native.py --edgespec-auto`)."""

from __future__ import annotations

import pytest

from edgespec.bench import anchor_compare as compare


def _rows(task: str, cat: str, rep: int, speeds: dict, over: int = 0) -> list[dict]:
    """Rows of one (task, repeat): a budget of 100 tokens, native runs making `over` more."""
    return [dict(task=task, category=cat, repeat=rep, n_max=n, tok_per_s=v, max_tokens=100,
                 n_tokens=100 if n == "auto" else 100 + over, decode_s=(100 if n == "auto" else 100 + over) / v)
            for n, v in speeds.items()]


def _table(capsys: pytest.CaptureFixture[str]) -> dict[str, list[str]]:
    out = capsys.readouterr().out.splitlines()
    return {ln.split(" | ")[0].strip("| "): ln.strip("| ").split(" | ") for ln in out}


def test_paired_ratios_are_taken_within_each_task_and_repeat(capsys: pytest.CaptureFixture[str]):
    rows = (_rows("a-1", "a", 0, {0: 100.0, 4: 120.0, 8: 150.0, "auto": 165.0})  # best n-max 8: 1.10
            + _rows("a-1", "a", 1, {0: 50.0, 4: 60.0, 8: 75.0, "auto": 82.5})  # a slow machine minute: same ratios
            + _rows("b-1", "b", 0, {0: 100.0, 4: 90.0, 8: 80.0, "auto": 99.0})  # best n-max 4: 1.10
            + _rows("b-2", "b", 0, {0: 100.0, 4: 100.0, 8: 70.0}))  # no edgespec run: left out
    compare.paired({"meta": {"n_max": [0, 4, 8]}, "rows": rows})
    t = _table(capsys)
    assert t["category"][-2:] == ["auto ÷ best n-max of each pair", "the same, native counted to the budget"]
    a, b, everything = t["a"], t["b"], t["all"]
    assert a[1] == "2" and a[-4:] == ["1.38", "1.10", "**1.10**", "1.10"]  # ÷ n-max 4, ÷ n-max 8, ÷ best
    assert b[1] == "1" and b[-2] == "**1.10**" and b[3] == "100.0"
    assert everything[1] == "3" and everything[-2] == "**1.10**"
    assert t["category"][6] == "auto ÷ native plain"  # native plain beside native's best speculative setting
    assert a[6] == "1.65" and b[6] == "0.99" and everything[6] == "1.65"


def test_native_tokens_past_the_budget_are_discounted_in_the_last_column(capsys: pytest.CaptureFixture[str]):
    # native n-max 8 made 125 tokens for a budget of 100 at 150 tok/s: 120 tok/s counting 100
    compare.paired({"meta": {"n_max": [0, 8]}, "rows": _rows("a-1", "a", 0, {0: 100.0, 8: 150.0, "auto": 150.0},
                                                               over=25)})
    a = _table(capsys)["a"]
    assert a[-2:] == ["**1.00**", "1.25"]


def test_paired_without_edgespec_rows_says_so():
    with pytest.raises(SystemExit, match="--edgespec-auto"):
        compare.paired({"meta": {"n_max": [0, 4]}, "rows": _rows("a-1", "a", 0, {0: 1.0, 4: 2.0})})
