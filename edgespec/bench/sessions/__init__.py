"""Session suites: fixed sequences of requests sent to one engine in order, where what the engine saw
in earlier turns is meant to help later ones (an editor re-sending a file, an agent loop).
`edgespec bench --suite edit-session` / `--suite agent-loop`; docs/bench-sessions.md.

A session file is JSONL, one session per line, an object with exactly these keys:
    id        unique non-empty string without "/", e.g. "edit-01"
    category  non-empty string (the bench's per-category rows), e.g. "edit_session"
    source    non-empty string: where the session's text comes from (repository, entry, license)
    turns     non-empty list of turns, each an object with:
        messages    the complete request: [{"role": "system"|"user"|"assistant", "content": str}, ...],
                    ending with a user message. Fixed in advance (it never depends on what a model
                    answered), so an OpenAI client can send the very same sequence to any server.
        max_tokens  int, MIN_MAX_TOKENS..MAX_MAX_TOKENS
        expected    optional string: the answer the turn asks for (not used by the bench, which
                    measures speed; tests check the suites against it)

Turn k (1-based) of session S is the Task f"{S}/t{k}" of S's category. Its `prompt`, for base models
without a chat template, is `plain_prompt(messages)`: "System: …\\n\\nUser: …\\n\\nAssistant: …\\n\\n
User: …\\n\\nAssistant:", the shipped suite's plain form. The bench clears the drafter's memory at the
start of each session only (edgespec/bench/run.py: start_cold).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgespec.bench.tasks import (
    Task,
    check_keys,
    check_max_tokens,
    check_messages,
    check_text,
    in_categories,
    json_object,
    read_jsonl,
)
from edgespec.errors import EdgespecError

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

HERE: Traversable = resources.files(__name__)
SUITES: dict[str, str] = {"edit-session": "edit_session.jsonl", "agent-loop": "agent_loop.jsonl"}
_KEYS = ("id", "category", "source", "turns")
_TURN_KEYS = ("messages", "max_tokens", "expected")


@dataclass(frozen=True)
class Session:
    """Turns sent to one engine in order; each turn is a Task (id f"{id}/t{k}")."""

    id: str
    category: str
    turns: tuple[Task, ...]
    source: str = ""
    expected: tuple[str | None, ...] = ()  # per turn (empty: none given)


def as_session(item: Task | Session) -> Session:
    """A Session as is; a single-shot Task as a session of one turn (the bench runs both alike)."""
    return item if isinstance(item, Session) else Session(item.id, item.category, (item,))


def cap_tokens(item: Task | Session, max_tokens: int | None) -> Task | Session:
    """`item` with every turn's max_tokens at most `max_tokens` (None: unchanged)."""
    if max_tokens is None:
        return item
    if isinstance(item, Task):
        return dataclasses.replace(item, max_tokens=min(item.max_tokens, max_tokens))
    return dataclasses.replace(item, turns=tuple(cap_tokens(t, max_tokens) for t in item.turns))


def plain_prompt(messages: Sequence[dict[str, str]]) -> str:
    """A conversation as plain text a base model continues: "Role: content" blocks, then "Assistant:"."""
    return "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages) + "Assistant:"


def _turn(obj: Any, sid: str, category: str, k: int, where: str) -> tuple[Task, str | None]:
    where = f"{where}: turns[{k - 1}]"
    if not isinstance(obj, dict):
        raise EdgespecError(f"{where} must be an object with 'messages' and 'max_tokens'")
    check_keys(obj, _TURN_KEYS[:2], _TURN_KEYS, where)
    messages = check_messages(obj["messages"], where)
    max_tokens = check_max_tokens(obj["max_tokens"], where)
    expected = check_text(obj, "expected", where) if "expected" in obj else None
    return Task(f"{sid}/t{k}", category, messages, plain_prompt(messages), max_tokens), expected


def parse_session(line: str, where: str) -> Session:
    """One JSONL line as a Session, or an EdgespecError naming `where` (file:line) and the problem."""
    obj = json_object(line, where)
    check_keys(obj, _KEYS, _KEYS, where)
    sid, category, source = (check_text(obj, k, where) for k in ("id", "category", "source"))
    if "/" in sid:
        raise EdgespecError(f"{where}: 'id' must not contain '/' (turn ids are ID/tK; got {sid!r})")
    turns = obj["turns"]
    if not isinstance(turns, list) or not turns:
        raise EdgespecError(f"{where}: 'turns' must be a non-empty list of turn objects")
    parsed = [_turn(t, sid, category, k, where) for k, t in enumerate(turns, 1)]
    return Session(sid, category, tuple(t for t, _ in parsed), source, tuple(e for _, e in parsed))


def suite_file(name: str) -> Traversable:
    """The vendored file of a session suite (SUITES), or an EdgespecError naming the known ones."""
    if name not in SUITES:
        raise EdgespecError(f"no session suite {name!r} (known: {', '.join(SUITES)})")
    file = HERE / SUITES[name]
    if not file.is_file():
        raise EdgespecError(f"the {name} suite is not at {file} (the package data is missing from this install)")
    return file


def load_sessions(path: str | Path | Traversable, categories: Sequence[str] | None = None) -> list[Session]:
    """The sessions of a JSONL file (a SUITES name: its vendored file), in file order; `categories`
    keeps only those (one with no session is an error).

    Raises:
        EdgespecError with one line naming file:line (and the turn) and the problem, or the unreadable file.
    """
    file = suite_file(path) if path in SUITES else Path(path) if isinstance(path, str) else path
    sessions = read_jsonl(file, parse_session, {}, f"session file {file}", lambda s: f"session id {s.id!r}")
    if not sessions:
        raise EdgespecError(f"no sessions in {file}")
    return in_categories(sessions, categories, "sessions")
