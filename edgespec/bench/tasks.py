"""The benchmark task suite: JSONL files of prompts, one task per line, validated on load.

The default suite ships inside the package (edgespec/bench/suite/*.jsonl, package data), so it loads
from an installed wheel as well as from a source checkout.

Each line is an object with exactly these keys:
    id          unique non-empty string, e.g. "chat-01"
    category    non-empty string, e.g. "chat" (see CATEGORIES for the shipped ones)
    messages    [{"role": "system"|"user"|"assistant", "content": str}, ...], ending with a user turn;
                used with the model's chat template (instruct models)
    prompt      the same task as plain text that a base model can continue
    max_tokens  int, MIN_MAX_TOKENS..MAX_MAX_TOKENS: how many tokens to generate
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from edgespec.errors import EdgespecError

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

CATEGORIES: tuple[str, ...] = ("chat", "code_edit", "summarize_quote", "json_extract", "story", "multi_turn")
# A Traversable, not a Path: package data need not be a plain directory (e.g. a zipped install).
DEFAULT_TASKS_DIR: Traversable = resources.files("edgespec.bench") / "suite"
MIN_MAX_TOKENS, MAX_MAX_TOKENS = 1, 4096
ROLES = ("system", "user", "assistant")
_KEYS = ("id", "category", "messages", "prompt", "max_tokens")


@dataclass(frozen=True)
class Task:
    """One benchmark prompt: `messages` for chat-template models, `prompt` for base models."""

    id: str
    category: str
    messages: tuple[dict[str, str], ...]
    prompt: str
    max_tokens: int


def check_messages(messages: Any, where: str) -> tuple[dict[str, str], ...]:
    """`messages` as a tuple of {"role", "content"} dicts, ending with a user turn, or an EdgespecError
    naming `where` and the problem."""
    if not isinstance(messages, list) or not messages:
        raise EdgespecError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise EdgespecError(f"{where}: messages[{i}] must be an object with exactly 'role' and 'content'")
        if m["role"] not in ROLES:
            raise EdgespecError(f"{where}: messages[{i}] has role {m['role']!r} (expected one of {ROLES})")
        if not isinstance(m["content"], str) or not m["content"].strip():
            raise EdgespecError(f"{where}: messages[{i}] 'content' must be a non-empty string")
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"] != "user":
        raise EdgespecError(f"{where}: the last message must have role 'user' (got {out[-1]['role']!r})")
    return tuple(out)


def json_object(line: str, where: str) -> dict[str, Any]:
    """One JSONL line as an object, or an EdgespecError naming `where` (file:line) and the problem."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise EdgespecError(f"{where}: bad JSON: {err.msg} (column {err.colno})") from None
    if not isinstance(obj, dict):
        raise EdgespecError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def check_keys(obj: dict[str, Any], required: Sequence[str], allowed: Sequence[str], where: str) -> None:
    """An EdgespecError naming `where` if `obj` lacks a required key or has one not allowed."""
    missing = [k for k in required if k not in obj]
    if missing:
        raise EdgespecError(f"{where}: missing key(s) {', '.join(map(repr, missing))}")
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        raise EdgespecError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} (allowed: {', '.join(allowed)})")


def check_text(obj: dict[str, Any], key: str, where: str) -> str:
    """obj[key], which must be a non-empty string (an EdgespecError naming `where` otherwise)."""
    value = obj[key]
    if not isinstance(value, str) or not value.strip():
        raise EdgespecError(f"{where}: {key!r} must be a non-empty string (got {value!r:.60})")
    return value


def _parse_line(line: str, where: str) -> Task:
    obj = json_object(line, where)
    check_keys(obj, _KEYS, _KEYS, where)
    for key in ("id", "category", "prompt"):
        check_text(obj, key, where)
    max_tokens = check_max_tokens(obj["max_tokens"], where)
    messages = check_messages(obj["messages"], where)
    return Task(obj["id"], obj["category"], messages, obj["prompt"], max_tokens)


def check_max_tokens(max_tokens: Any, where: str) -> int:
    """`max_tokens` if it is an int in MIN_MAX_TOKENS..MAX_MAX_TOKENS, else a one-line EdgespecError."""
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        raise EdgespecError(f"{where}: 'max_tokens' must be an integer (got {type(max_tokens).__name__})")
    if not MIN_MAX_TOKENS <= max_tokens <= MAX_MAX_TOKENS:
        raise EdgespecError(f"{where}: 'max_tokens' is {max_tokens}, out of range "
                            f"{MIN_MAX_TOKENS}..{MAX_MAX_TOKENS}")
    return max_tokens


def _files(path: Traversable) -> list[Traversable]:
    if path.is_dir():
        files = sorted((p for p in path.iterdir() if p.name.endswith(".jsonl") and p.is_file()),
                       key=lambda p: p.name)
        if not files:
            raise EdgespecError(f"no .jsonl task files in {path}")
        return files
    if path.is_file():
        return [path]
    raise EdgespecError(f"task file or directory not found: {path}")


def load_tasks(path: str | Path | Traversable | None = None,
               categories: Sequence[str] | None = None) -> list[Task]:
    """Load and validate tasks from a .jsonl file or a directory of them (default: the shipped suite).

    Tasks come in file order, files in name order. `categories` keeps only those categories (in
    file order); naming a category that has no task is an error.

    Raises:
        EdgespecError with one line naming file:line and the problem (bad JSON, missing or unknown
        key, wrong type, duplicate id, max_tokens out of range), or the missing path.
    """
    if path is None:
        if not DEFAULT_TASKS_DIR.is_dir():
            raise EdgespecError(f"the task suite is not at {DEFAULT_TASKS_DIR} (the package data is "
                                "missing from this install); pass a tasks path explicitly")
        path = DEFAULT_TASKS_DIR
    tasks: list[Task] = []
    seen: dict[str, str] = {}
    for file in _files(Path(path) if isinstance(path, str) else path):
        tasks += read_jsonl(file, _parse_line, seen, f"task file {file}", lambda task: f"id {task.id!r}")
    if not tasks:
        raise EdgespecError(f"no tasks in {path}")
    return in_categories(tasks, categories, "tasks")


class _Item(Protocol):  # a Task or a bench.sessions.Session
    @property
    def id(self) -> str: ...

    @property
    def category(self) -> str: ...


T = TypeVar("T", bound=_Item)


def in_categories(items: list[T], categories: Sequence[str] | None, what: str) -> list[T]:
    """`items` of those categories (file order kept; None: all); a category with no item is an error
    naming the available ones (`what`: "tasks", "sessions")."""
    if categories is None:
        return items
    wanted = list(dict.fromkeys(categories))
    present = {t.category for t in items}
    absent = [c for c in wanted if c not in present]
    if absent:
        raise EdgespecError(f"no {what} in category {', '.join(map(repr, absent))} "
                            f"(available: {', '.join(sorted(present))})")
    return [t for t in items if t.category in wanted]


def first_per_category(items: Sequence[T], n: int) -> list[T]:
    """The first `n` items of each category, grouped by category (categories in order of appearance)."""
    by_cat: dict[str, list[T]] = {}
    for t in items:
        if len(group := by_cat.setdefault(t.category, [])) < n:
            group.append(t)
    return [t for group in by_cat.values() for t in group]


def read_jsonl(file: Path | Traversable, parse: Callable[[str, str], T], seen: dict[str, str], what: str,
               name: Callable[[T], str]) -> list[T]:
    """The items (tasks, sessions) of a JSONL file, one per non-blank line (`parse(line, "file:line")`);
    `seen` maps the ids read so far (across files) to where, so a duplicate is one line naming both places."""
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise EdgespecError(f"cannot read {what}: {err}") from None
    items = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{file}:{n}"
        item = parse(line, where)
        if item.id in seen:
            raise EdgespecError(f"{where}: duplicate {name(item)} (first at {seen[item.id]})")
        seen[item.id] = where
        items.append(item)
    return items
