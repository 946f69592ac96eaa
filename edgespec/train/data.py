"""Training text for feature heads: a capped corpus of plain text this machine already has, kept
disjoint from the benchmark prompts, and the draft vocabulary (d2t) counted from it.

Sources (``local_corpus``): the Python standard library's sources (code and docstrings) and the
plain-text files under /usr/share/doc. Compressed files (man pages are gzipped troff) and files
that do not decode as UTF-8 or look binary are skipped. Files are taken in a seeded order and
the total is capped, so the corpus is reproducible on one machine.

Disjointness: every chunk that shares an ``NGRAM``-word sequence with a bench task prompt or a
test prompt is dropped (``Forbidden``), so no evaluation text can leak into training.
"""

from __future__ import annotations

import random
import re
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from edgespec.bench.sessions import SUITES, load_sessions
from edgespec.bench.spec_bench import load_questions
from edgespec.bench.tasks import load_tasks

NGRAM = 8
_REPO = Path(__file__).resolve().parents[2]
_WORD = re.compile(r"\w+")


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    """The n-word sequences of ``text`` (lower-cased \\w+ words)."""
    w = _WORD.findall(text.lower())
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def evaluation_texts(repo: Path = _REPO) -> list[str]:
    """Texts training must never contain: every task of the shipped bench suite, of Spec-Bench and of
    the session suites (prompt and messages) and, in a source checkout, ``repo``/tests/real_prompts.py."""
    tasks = load_tasks() + load_questions()
    for name in SUITES:
        tasks += [turn for session in load_sessions(name) for turn in session.turns]
    out: list[str] = []
    for task in tasks:
        out.append(task.prompt)
        out += [m["content"] for m in task.messages]
    rp = repo / "tests" / "real_prompts.py"
    if rp.is_file():
        out.append(rp.read_text())
    return out


class Forbidden:
    """The n-grams of the evaluation texts; ``clean(text)`` is True when ``text`` shares none."""

    def __init__(self, texts: Iterable[str], n: int = NGRAM) -> None:
        self.n = n
        self.grams: set[tuple[str, ...]] = set()
        for t in texts:
            self.grams |= ngrams(t, n)

    def clean(self, text: str) -> bool:
        return not (ngrams(text, self.n) & self.grams)


def _plain_text(path: Path, max_bytes: int) -> str | None:
    """The file's text if it is small plain UTF-8 text, else None."""
    try:
        if path.is_symlink() or not path.is_file() or path.suffix in (".gz", ".bz2", ".xz", ".zip", ".pdf"):
            return None
        raw = path.read_bytes()[:max_bytes]
    except OSError:
        return None
    if b"\0" in raw:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    printable = sum(c.isprintable() or c in "\n\t" for c in text)
    return text if text.strip() and printable >= 0.97 * len(text) else None


def source_files(roots: Sequence[Path] | None = None) -> list[Path]:
    """Candidate files: stdlib *.py (no tests) and everything under /usr/share/doc, sorted."""
    if roots is None:
        roots = [Path(sysconfig.get_paths()["stdlib"]), Path("/usr/share/doc")]
    files: list[Path] = []
    for root in roots:
        if not root.is_dir():
            continue
        for p in root.rglob("*"):
            if "site-packages" in p.parts or "test" in p.parts or "tests" in p.parts:
                continue
            if root.name == "doc" or p.suffix == ".py":
                files.append(p)
    return sorted(files)


def local_corpus(max_chars: int = 2_000_000, chunk_chars: int = 4000, seed: int = 0,
                 forbidden: Forbidden | None = None, roots: Sequence[Path] | None = None) -> Iterator[str]:
    """Plain-text chunks of at most ``chunk_chars`` characters, ``max_chars`` in all.

    Args:
        max_chars: total cap.
        chunk_chars: chunk size (split at line ends where possible).
        seed: order of the files.
        forbidden: chunks it does not call clean are dropped (default: the bench and test prompts).
        roots: directories to read (default: the stdlib and /usr/share/doc).
    """
    forbidden = forbidden or Forbidden(evaluation_texts())
    files = source_files(roots)
    random.Random(seed).shuffle(files)
    total = 0
    for path in files:
        text = _plain_text(path, 4 * chunk_chars)
        if text is None:
            continue
        for start in range(0, len(text), chunk_chars):
            piece = text[start:start + chunk_chars]
            cut = piece.rfind("\n")
            if start + chunk_chars < len(text) and cut > chunk_chars // 2:
                piece = piece[:cut + 1]
            if len(piece.strip()) < 200 or not forbidden.clean(piece):
                continue
            yield piece
            total += len(piece)
            if total >= max_chars:
                return


def draft_vocab(token_counts: npt.NDArray[np.int64], size: int,
                always: Sequence[int] = ()) -> npt.NDArray[np.int64]:
    """d2t: the ``size`` most frequent target ids (ties: lower id first), ``always`` included,
    sorted ascending. llama.cpp reads it as I64 absolute target ids (draft id i → d2t[i])."""
    n_vocab = len(token_counts)
    size = min(size, n_vocab)
    key = token_counts.astype(np.float64).copy()
    key[list(always)] = np.inf
    order = np.lexsort((np.arange(n_vocab), -key))  # most frequent first, ties by id
    return np.sort(order[:size]).astype(np.int64)


def target_to_draft(d2t: npt.NDArray[np.int64], n_vocab: int) -> npt.NDArray[np.int64]:
    """t2d: target id → draft id, −1 outside the draft vocabulary."""
    t2d = np.full(n_vocab, -1, np.int64)
    t2d[d2t] = np.arange(len(d2t))
    return t2d
