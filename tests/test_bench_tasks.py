"""The shipped benchmark task suite and the loader's one-line errors for malformed task files."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from edgespec.bench import tasks as tasks_mod
from edgespec.bench.tasks import CATEGORIES, Task, load_tasks
from edgespec.errors import EdgespecError

GOOD = {"id": "t-01", "category": "chat", "messages": [{"role": "user", "content": "Hi?"}],
        "prompt": "Question: Hi?\nAnswer:", "max_tokens": 64}


def test_shipped_suite_loads_with_every_category() -> None:
    tasks = load_tasks()
    counts = Counter(t.category for t in tasks)
    assert set(counts) == set(CATEGORIES) and len(CATEGORIES) >= 6
    assert all(n >= 8 for n in counts.values()), counts
    assert len({t.id for t in tasks}) == len(tasks)


def test_shipped_tasks_are_complete() -> None:
    for t in load_tasks():
        assert isinstance(t, Task)
        assert t.id.startswith(f"{t.category}-")
        assert t.messages and t.messages[-1]["role"] == "user"
        assert all(m["content"].strip() for m in t.messages)
        assert t.prompt.strip()
        assert 64 <= t.max_tokens <= 256
    multi = load_tasks(categories=["multi_turn"])
    for t in multi:
        roles = [m["role"] for m in t.messages]
        assert 3 <= len(roles) - 1 <= 5, t.id
        assert all(a != b for a, b in zip(roles, roles[1:])) and set(roles) == {"user", "assistant"}, t.id


def test_category_filter_and_paths() -> None:
    code = load_tasks(categories=("code_edit",))
    assert code and {t.category for t in code} == {"code_edit"}
    one_file = load_tasks(tasks_mod.DEFAULT_TASKS_DIR / "story.jsonl")
    assert [t.id for t in one_file] == [t.id for t in load_tasks(categories=["story"])]
    with pytest.raises(EdgespecError, match="no tasks in category 'nope'"):
        load_tasks(categories=["nope"])


def _write(tmp_path: Path, *lines: object) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _error(path: Path) -> str:
    with pytest.raises(EdgespecError) as info:
        load_tasks(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_good_file_loads(tmp_path: Path) -> None:
    (task,) = load_tasks(_write(tmp_path, "", GOOD, "   "))
    assert task == Task("t-01", "chat", ({"role": "user", "content": "Hi?"},), "Question: Hi?\nAnswer:", 64)


@pytest.mark.parametrize(("line", "expected"), [
    ('{"id": "t-02", "category": ', "bad JSON"),
    ([1, 2], "expected a JSON object, got list"),
    ({k: v for k, v in GOOD.items() if k != "prompt"}, "missing key(s) 'prompt'"),
    ({**GOOD, "max_token": 64}, "unknown key(s) 'max_token'"),
    ({**GOOD, "id": 7}, "'id' must be a non-empty string"),
    ({**GOOD, "prompt": "  "}, "'prompt' must be a non-empty string"),
    ({**GOOD, "max_tokens": "64"}, "'max_tokens' must be an integer (got str)"),
    ({**GOOD, "max_tokens": True}, "'max_tokens' must be an integer (got bool)"),
    ({**GOOD, "max_tokens": 0}, "'max_tokens' is 0, out of range"),
    ({**GOOD, "max_tokens": 100_000}, "'max_tokens' is 100000, out of range"),
    ({**GOOD, "messages": []}, "'messages' must be a non-empty list"),
    ({**GOOD, "messages": ["hi"]}, "messages[0] must be an object"),
    ({**GOOD, "messages": [{"role": "robot", "content": "x"}]}, "messages[0] has role 'robot'"),
    ({**GOOD, "messages": [{"role": "user", "content": 3}]}, "messages[0] 'content' must be a non-empty string"),
    ({**GOOD, "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
     "the last message must have role 'user'"),
])
def test_malformed_line_names_file_line_and_problem(tmp_path: Path, line: object, expected: str) -> None:
    path = _write(tmp_path, GOOD | {"id": "t-00"}, line)
    message = _error(path)
    assert message.startswith(f"{path}:2: ")
    assert expected in message


def test_duplicate_ids_across_files(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text(json.dumps(GOOD) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps(GOOD | {"id": "t-02"}) + "\n" + json.dumps(GOOD) + "\n")
    message = _error(tmp_path)
    assert message.startswith(f"{tmp_path / 'b.jsonl'}:2: duplicate id 't-01'")
    assert f"first at {tmp_path / 'a.jsonl'}:1" in message


def test_missing_and_empty_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert "not found" in _error(tmp_path / "absent.jsonl")
    assert "no .jsonl task files" in _error(tmp_path)
    assert "no tasks in" in _error(_write(tmp_path, ""))
    monkeypatch.setattr(tasks_mod, "DEFAULT_TASKS_DIR", tmp_path / "gone")
    with pytest.raises(EdgespecError, match="task suite is not at .*gone") as info:
        load_tasks()
    assert "\n" not in str(info.value)
