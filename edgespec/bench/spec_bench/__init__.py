"""Spec-Bench as an edgespec bench suite: `edgespec bench --suite spec-bench`.

Spec-Bench (Xia et al., "Unlocking Efficiency in Large Language Model Inference: A Comprehensive Survey
of Speculative Decoding", ACL 2024 Findings) is the public benchmark speculative-decoding methods
report their speedups on. Its 480 prompts are vendored unchanged, byte for byte, next to this file
(question.jsonl, from hemingkx/Spec-Bench at UPSTREAM_COMMIT, Apache-2.0: LICENSE and README.md here).

Each upstream line is {"question_id": int, "category": str, "turns": [str, ...], "reference": ...}.
It becomes a `Task` with:
    id          f"spec-bench-{question_id}"
    category    one of CATEGORIES, Spec-Bench's six subtasks: the 80 MT-bench questions (upstream
                categories writing, roleplay, reasoning, math, coding, extraction, stem, humanities,
                10 each) are "multi_turn"; the other five keep their upstream names
    messages    the first turn as one user message (chat-template models). Only the first turn is
                used: an MT-bench second turn follows up on the model's own first answer, which a
                fixed prompt cannot contain.
    prompt      "Question: {turn}\\nAnswer:" for base models, as the shipped suite writes it
    max_tokens  MAX_TOKENS (`edgespec bench --max-tokens` lowers it)
"reference" (the datasets' reference answers) is not used: the bench measures speed, not quality.

Selection is deterministic and spread over each category: `per_category=n` takes the questions at
positions i*size//n (i = 0..n-1) of the category in file order, e.g. every 40th for n=2 out of 80,
so with n=8 multi_turn takes one question of each MT-bench category.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from edgespec.bench.tasks import Task, json_object, read_jsonl
from edgespec.errors import EdgespecError

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

UPSTREAM_REPO = "hemingkx/Spec-Bench"
UPSTREAM_COMMIT = "fd2c1cd7d2201ef71db4c5f4e455008f017967bf"
UPSTREAM_PATH = "data/spec_bench/question.jsonl"
QUESTIONS: Traversable = resources.files(__name__) / "question.jsonl"

CATEGORIES: tuple[str, ...] = ("multi_turn", "translation", "summarization", "qa", "math_reasoning", "rag")
MT_BENCH_CATEGORIES: tuple[str, ...] = ("writing", "roleplay", "reasoning", "math", "coding", "extraction",
                                        "stem", "humanities")
# upstream category -> edgespec category
CATEGORY_MAP: dict[str, str] = {**dict.fromkeys(MT_BENCH_CATEGORIES, "multi_turn"),
                                **{c: c for c in CATEGORIES[1:]}}
MAX_TOKENS = 128


def _task(line: str, where: str) -> Task:
    row = json_object(line, where)
    qid, category, turns = row.get("question_id"), row.get("category"), row.get("turns")
    if not isinstance(qid, int) or isinstance(qid, bool):
        raise EdgespecError(f"{where}: 'question_id' must be an integer (got {qid!r:.60})")
    if category not in CATEGORY_MAP:
        raise EdgespecError(f"{where}: unknown Spec-Bench category {category!r:.60} "
                            f"(known: {', '.join(CATEGORY_MAP)})")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise EdgespecError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
    first = turns[0]
    return Task(id=f"spec-bench-{qid}", category=CATEGORY_MAP[category],
                messages=({"role": "user", "content": first},), prompt=f"Question: {first}\nAnswer:",
                max_tokens=MAX_TOKENS)


def load_questions(path: str | Path | Traversable | None = None) -> list[Task]:
    """All Spec-Bench questions as Tasks, in file order (default: the vendored question.jsonl).

    Raises:
        EdgespecError with one line naming file:line and the problem (bad JSON, an unknown upstream
        category, a missing or malformed field, a duplicate question_id), or the unreadable file.
    """
    file = QUESTIONS if path is None else Path(path) if isinstance(path, str) else path
    tasks = read_jsonl(file, _task, {}, f"the Spec-Bench questions at {file}",
                       lambda task: f"question_id {task.id.removeprefix('spec-bench-')}")
    if not tasks:
        raise EdgespecError(f"no Spec-Bench questions in {file}")
    return tasks


def spread(tasks: Sequence[Task], n: int) -> list[Task]:
    """`n` of `tasks` evenly spread over them: positions i*len//n for i = 0..n-1 (all if n >= len)."""
    if n < 1:
        raise ValueError(f"per_category must be >= 1 (got {n})")
    size = len(tasks)
    return list(tasks) if n >= size else [tasks[i * size // n] for i in range(n)]


def load_spec_bench(categories: Sequence[str] | None = None, per_category: int | None = None,
                    path: str | Path | Traversable | None = None) -> list[Task]:
    """Spec-Bench's tasks, category by category in CATEGORIES order (file order within a category).

    `categories` keeps only those (edgespec's names, CATEGORIES); an unknown one is an error.
    `per_category` takes that many per category, spread evenly (`spread`); None takes all.
    """
    tasks = load_questions(path)
    wanted = list(CATEGORIES) if categories is None else list(dict.fromkeys(categories))
    unknown = [c for c in wanted if c not in CATEGORIES]
    if unknown:
        raise EdgespecError(f"no Spec-Bench category {', '.join(map(repr, unknown))} "
                            f"(available: {', '.join(CATEGORIES)})")
    out: list[Task] = []
    for cat in (c for c in CATEGORIES if c in wanted):
        in_cat = [t for t in tasks if t.category == cat]
        if not in_cat:
            raise EdgespecError(f"no Spec-Bench questions in category {cat!r}")
        out.extend(in_cat if per_category is None else spread(in_cat, per_category))
    return out
