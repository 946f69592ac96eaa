"""Spec-Bench as a bench suite: the vendored file, its mapping to Tasks, the selection, `--suite`."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from edgespec.bench import spec_bench
from edgespec.bench.spec_bench import (
    CATEGORIES,
    MAX_TOKENS,
    MT_BENCH_CATEGORIES,
    QUESTIONS,
    load_questions,
    load_spec_bench,
    spread,
)
from edgespec.bench.tasks import load_tasks
from edgespec.cli import app as cli
from edgespec.errors import EdgespecError

# hemingkx/Spec-Bench @ fd2c1cd7d2201ef71db4c5f4e455008f017967bf, data/spec_bench/question.jsonl
UPSTREAM_SHA256 = "4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04"
UPSTREAM_COUNTS = {**dict.fromkeys(MT_BENCH_CATEGORIES, 10), **dict.fromkeys(CATEGORIES[1:], 80)}


def _rows() -> list[dict]:
    return [json.loads(line) for line in QUESTIONS.read_text(encoding="utf-8").splitlines()]


def test_vendored_file_is_the_upstream_one() -> None:
    """Byte for byte the pinned upstream file (README.md names the same hash), with its license."""
    assert hashlib.sha256(QUESTIONS.read_bytes()).hexdigest() == UPSTREAM_SHA256
    readme = (QUESTIONS.parent / "README.md").read_text(encoding="utf-8")
    assert UPSTREAM_SHA256 in readme and spec_bench.UPSTREAM_COMMIT in readme
    assert "Apache License" in (QUESTIONS.parent / "LICENSE").read_text(encoding="utf-8")
    rows = _rows()
    assert len(rows) == 480
    assert Counter(r["category"] for r in rows) == UPSTREAM_COUNTS


def test_six_categories_of_80() -> None:
    tasks = load_questions()
    assert Counter(t.category for t in tasks) == dict.fromkeys(CATEGORIES, 80)
    assert [t.id for t in tasks] == [f"spec-bench-{n}" for n in range(81, 561)]  # unique, file order


def test_tasks_are_the_first_turns_and_validate(tmp_path: Path) -> None:
    tasks, rows = load_questions(), _rows()
    for t, r in zip(tasks, rows, strict=True):
        assert t.id == f"spec-bench-{r['question_id']}"
        assert t.messages == ({"role": "user", "content": r["turns"][0]},)
        assert t.prompt == f"Question: {r['turns'][0]}\nAnswer:"
        assert t.max_tokens == MAX_TOKENS
        assert (len(r["turns"]) == 2) == (t.category == "multi_turn")  # only MT-bench rows have 2 turns
    # every Task passes the bench's own task-file validation
    file = tmp_path / "spec_bench.jsonl"
    file.write_text("".join(json.dumps({"id": t.id, "category": t.category, "messages": list(t.messages),
                                        "prompt": t.prompt, "max_tokens": t.max_tokens}) + "\n"
                            for t in tasks), encoding="utf-8")
    assert load_tasks(file) == tasks


def test_selection_is_deterministic_and_spread() -> None:
    by_id = {f"spec-bench-{r['question_id']}": r for r in _rows()}
    all_tasks = load_spec_bench()
    assert len(all_tasks) == 480
    two = load_spec_bench(per_category=2)
    assert two == load_spec_bench(per_category=2)
    assert [t.category for t in two] == [c for c in CATEGORIES for _ in range(2)]
    for cat in CATEGORIES:
        in_cat = [t for t in all_tasks if t.category == cat]
        assert [t for t in two if t.category == cat] == [in_cat[0], in_cat[40]]
    assert len(load_spec_bench(per_category=3)) == 18  # the bench's default --per-category
    assert load_spec_bench(per_category=80) == load_spec_bench(per_category=500) == all_tasks
    # 8 of multi_turn: one question of each MT-bench category
    eight = load_spec_bench(["multi_turn"], 8)
    assert [by_id[t.id]["category"] for t in eight] == list(MT_BENCH_CATEGORIES)
    with pytest.raises(ValueError, match="per_category"):
        spread(all_tasks, 0)


def test_category_filter() -> None:
    got = load_spec_bench(["rag", "qa", "rag"], 1)  # CATEGORIES order, duplicates ignored
    assert [(t.category, t.id) for t in got] == [("qa", "spec-bench-321"), ("rag", "spec-bench-481")]
    with pytest.raises(EdgespecError, match=r"no Spec-Bench category 'math'.*available: multi_turn"):
        load_spec_bench(["qa", "math"])  # an upstream MT-bench name is not an edgespec category


@pytest.mark.parametrize(("row", "needle"), [
    ({"question_id": 1, "category": "poetry", "turns": ["x"]}, "unknown Spec-Bench category 'poetry'"),
    ({"question_id": "1", "category": "qa", "turns": ["x"]}, "'question_id' must be an integer"),
    ({"question_id": 1, "category": "qa", "turns": []}, "'turns' must be a non-empty list"),
    ({"question_id": 1, "category": "qa", "turns": ["  "]}, "'turns' must be a non-empty list"),
])
def test_bad_rows_are_one_line_errors(tmp_path: Path, row: dict, needle: str) -> None:
    file = tmp_path / "question.jsonl"
    file.write_text(json.dumps({"question_id": 0, "category": "rag", "turns": ["ok"]}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(EdgespecError) as info:
        load_questions(file)
    assert f"{file}:2: " in str(info.value) and needle in str(info.value) and "\n" not in str(info.value)


def test_duplicate_question_id(tmp_path: Path) -> None:
    file = tmp_path / "question.jsonl"
    file.write_text(2 * (json.dumps({"question_id": 7, "category": "qa", "turns": ["x"]}) + "\n"))
    with pytest.raises(EdgespecError, match=r":2: duplicate question_id 7 \(first at .*:1\)"):
        load_questions(file)


runner = CliRunner()


@pytest.mark.parametrize(("args", "needles"), [
    (["--suite", "spec-bench", "--tasks", "x.jsonl"], ("--suite", "--tasks", "mutually exclusive")),
    (["--suite", "shipped", "--tasks", "x.jsonl"], ("--suite", "--tasks", "mutually exclusive")),
    (["--suite", "mt-bench"], ("'mt-bench'", "shipped, spec-bench")),
    (["--suite", "spec-bench", "--category", "chat"], ("no Spec-Bench category 'chat'",)),
])
def test_bench_suite_errors_before_any_model(tmp_path: Path, args: list[str], needles: tuple[str, ...]) -> None:
    # the target does not exist: each error comes before a model would be opened
    result = runner.invoke(cli.app, ["bench", "--target", str(tmp_path / "missing.gguf"), *args])
    assert result.exit_code == 1, result.output
    [line] = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert line.startswith("error: ") and all(n in line for n in needles), line
