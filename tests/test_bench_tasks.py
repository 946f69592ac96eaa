"""The shipped benchmark task suite and the loader's one-line errors for malformed task files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from edgespec.bench import tasks as tasks_mod
from edgespec.bench.sessions import HERE as SESSIONS_DIR
from edgespec.bench.sessions import SUITES, load_sessions
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


_INSTALLED_SUITE = """
import collections, json, edgespec.bench.tasks as t, edgespec.bench.sessions as s
tasks = t.load_tasks()
sessions = {name: len(s.load_sessions(name)) for name in s.SUITES}
licenses = sorted(p.name for p in (s.HERE / "licenses").iterdir())
print(json.dumps({"file": t.__file__, "counts": collections.Counter(x.category for x in tasks),
                  "sessions": sessions, "licenses": licenses}))
"""


# ~5 s here (a wheel build without build isolation), so not marked slow.
def test_suite_loads_from_an_installed_wheel(tmp_path: Path) -> None:
    """The suites are package data: a wheel installed away from the checkout loads every category of
    the task suite, both session suites and their sources' licenses."""
    repo, src = Path(__file__).resolve().parents[1], tmp_path / "src"
    # Built from a copy: an in-tree build would write build/ and *.egg-info into the checkout.
    shutil.copytree(repo / "edgespec", src / "edgespec", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(repo / name, src / name)
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "--quiet"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)],
                   check=True, cwd=tmp_path, env={**os.environ, "PIP_NO_INDEX": "1"})
    (wheel,) = wheels.glob("edgespec-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
                   check=True, cwd=tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", _INSTALLED_SUITE], check=True, cwd=tmp_path, env=env,
                         capture_output=True, text=True).stdout
    got = json.loads(out)
    assert Path(got["file"]).is_relative_to(site)  # the installed copy, not the checkout
    assert set(got["counts"]) == set(CATEGORIES)
    assert got["counts"] == Counter(t.category for t in load_tasks())
    assert got["sessions"] == {name: len(load_sessions(name)) for name in SUITES}
    assert got["licenses"] == sorted(p.name for p in (SESSIONS_DIR / "licenses").iterdir())
