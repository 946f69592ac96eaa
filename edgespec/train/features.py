"""The on-disk training cache: target features and soft labels per token chunk, resumable.

One file per sequence, ``seq_NNNNN.npz``, written atomically (temp file + rename), holding:

* ``tokens`` int32 (L,): the sequence (BOS first where the tokenizer adds one);
* ``feats`` float16 (L, 3·H_t) and ``feat_scale`` float32 (L,): the target's features at each
  position (inputs of its 3 target layers, ``LlamaFeatureBackend``) are ``feats · feat_scale``.
  fp16 halves the cache; the per-row scale (1 unless the row holds values beyond ±32768) keeps
  residual streams with huge outlier dimensions (Gemma-3) finite. ``load_file`` applies it;
* ``n_prompt`` int32: how many leading tokens are the prompt of a generation (0 for corpus text); the
  held-out acceptance counts only drafts of the tokens after it;
* ``top_ids`` int32 (L, K), ``top_lp`` float16 (L, K): the target's K most likely next tokens at
  each position and their log-probabilities under the full softmax (temperature 1). K = 32 keeps
  ≥ 0.9 of the probability mass on most rows of a small model and costs 192 bytes a row instead of
  V·4; the mass outside the top K is dropped (the loss renormalises over what is kept);
* ``source`` str (``corpus``, ``prompt`` or a generated sequence's, e.g. ``gen:code``) and
  ``temperature`` float64 (what the reply was sampled at; 0 for greedy replies and corpus text).

``meta.json`` records the target, its layers and the sequence plan; a rerun with the same plan
skips the files already written, so an interrupted extraction resumes where it stopped.
``manifest.jsonl`` holds one line per written file (file, tokens, n_prompt, source, temperature),
appended as files are written and completed from the files when lines are missing, so token
counts and the data mix are known without opening every file (``FeatureCache.manifest``).
Sequences are corpus chunks (``data.local_corpus``) cut into windows of ``seq_len`` tokens, and
the target's own replies: greedy continuations of ``prompts.TRAIN_PROMPTS`` made here one at a
time, or finished sequences made beforehand in batches (``generate.self_distill``), which are
self-distillation data in the strict sense. A prompt is framed the way the runtime will show it: in
the model's chat template, or for a base model without one in ``BASE_PROMPT``, the framing of the
bench tasks' ``prompt`` field (``edgespec bench`` feeds a template-less target that text). A head
trained on raw prompts but measured on framed ones under-reports its acceptance (it happened to
the Gemma-3 heads: docs/experiments/trained-heads.md).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from edgespec.train.data import draft_vocab

BASE_PROMPT = "Question: {}\nAnswer:"  # a training prompt, for a target without a chat template
MANIFEST = "manifest.jsonl"


@dataclass(frozen=True)
class CachePlan:
    """What a cache holds; a cache directory is reused only for the same plan."""

    target: str
    target_size: int
    seq_len: int = 256
    top_k: int = 32
    corpus_chars: int = 1_000_000
    n_prompts: int = 0
    gen_tokens: int = 192
    seed: int = 0


def top_k_logprobs(logits: npt.NDArray[np.float32], k: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.float16]]:
    """Per row, the k largest log-softmax values (descending) and their ids. logits: (n, V)."""
    x = np.asarray(logits, np.float32)
    m = x.max(1)
    lse = np.log(np.exp(x - m[:, None]).sum(1)) + m
    ids = np.argpartition(x, x.shape[1] - k, axis=1)[:, -k:]
    vals = np.take_along_axis(x, ids, 1)
    order = np.argsort(-vals, axis=1, kind="stable")
    ids, vals = np.take_along_axis(ids, order, 1), np.take_along_axis(vals, order, 1)
    return ids.astype(np.int32), (vals - lse[:, None]).astype(np.float16)


def pack_features(f: npt.NDArray[np.float32]) -> tuple[npt.NDArray[np.float16], npt.NDArray[np.float32]]:
    """(L, D) float32 → (float16 rows, per-row scale): rows whose max |value| exceeds 32768 are divided
    by max/32768 so that they stay finite in float16."""
    scale = np.maximum(1.0, np.abs(f).max(1) / 32768.0).astype(np.float32)
    return (f / scale[:, None]).astype(np.float16), scale


def _windows(tokens: list[int], seq_len: int, min_len: int = 32) -> Iterator[list[int]]:
    for s in range(0, len(tokens), seq_len):
        w = tokens[s:s + seq_len]
        if len(w) >= min_len:
            yield w


def chat_tokens(backend: Any, prompt: str | Sequence[str]) -> list[int]:
    """A prompt as the runtime shows it: a chat in the target's template (``BASE_PROMPT`` turns if it
    has none), ready for the assistant's reply.

    Args:
        backend: the target (tokenize, metadata, vocab_fingerprint, bos_id, eos_id).
        prompt: one user message, or the turns of a conversation (user, assistant, ..., user).
    """
    from edgespec.chat import render_chat

    turns = [prompt] if isinstance(prompt, str) else list(prompt)
    if len(turns) % 2 == 0:
        raise ValueError(f"a prompt's turns must alternate user/assistant and end with the user (got {len(turns)})")
    template = backend.metadata("tokenizer.chat_template")
    if not template:
        said = "".join(BASE_PROMPT.format(u) + f" {a}\n" for u, a in zip(turns[:-1:2], turns[1::2]))
        return backend.tokenize(said + BASE_PROMPT.format(turns[-1]))
    text_of = backend.vocab_fingerprint().token_text
    bos = text_of(backend.bos_id) if backend.bos_id is not None else ""
    eos = text_of(backend.eos_id) if backend.eos_id is not None else ""
    messages = [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]
    text = render_chat(template, messages, bos_token=bos, eos_token=eos)
    return backend.tokenize(text, add_special=not (bos and text.startswith(bos)), parse_special=True)


class Generated(NamedTuple):
    """A finished self-distilled sequence (``generate.self_distill``): the rendered prompt's ids, the
    reply's ids (no end-of-generation token), the temperature it was sampled at (0: greedy) and its
    source (e.g. ``gen:code``)."""

    prompt: list[int]
    reply: list[int]
    temperature: float
    source: str


class FeatureCache:
    """A directory of ``seq_NNNNN.npz`` files (see the module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @property
    def meta(self) -> dict[str, Any]:
        return json.loads((self.root / "meta.json").read_text())

    def files(self) -> list[Path]:
        return sorted(self.root.glob("seq_*.npz"))

    def manifest(self) -> list[dict[str, Any]]:
        """Per sequence file, in file order: ``file``, ``tokens``, ``n_prompt``, ``source`` and
        ``temperature``, read from ``manifest.jsonl`` (entries it lacks are added from the files)."""
        entries = _sync_manifest(self.root, self.files())
        return [entries[f.name] for f in self.files()]

    @staticmethod
    def load_file(path: Path) -> dict[str, npt.NDArray[Any]]:
        """One sequence's arrays (tokens, feats (float32, scale applied), top_ids, top_lp, n_prompt)."""
        with np.load(path) as z:
            out = {k: z[k] for k in z.files}
        scale = out.pop("feat_scale", None)
        out["feats"] = out["feats"].astype(np.float32) * (1.0 if scale is None else scale[:, None])
        out.setdefault("n_prompt", np.int32(0))  # caches written before it was recorded: all text
        return out

    @staticmethod
    def describe(path: Path) -> dict[str, Any]:
        """A sequence file's manifest entry, read from the file (without its feature arrays)."""
        with np.load(path) as z:
            n_prompt = int(z["n_prompt"]) if "n_prompt" in z.files else 0
            source = str(z["source"]) if "source" in z.files else ("prompt" if n_prompt else "corpus")
            temperature = float(z["temperature"]) if "temperature" in z.files else 0.0
            return _entry(path.name, len(z["tokens"]), n_prompt, source, temperature)

    def token_counts(self, n_vocab: int) -> npt.NDArray[np.int64]:
        """How often each target id occurs among the cached tokens and top-1 labels."""
        counts = np.zeros(n_vocab, np.int64)
        for f in self.files():
            z = self.load_file(f)
            np.add.at(counts, z["tokens"].astype(np.int64), 1)
            np.add.at(counts, z["top_ids"][:, 0].astype(np.int64), 1)
        return counts

    def d2t(self, n_vocab: int, size: int, always: Sequence[int] = ()) -> npt.NDArray[np.int64]:
        """The draft vocabulary: the ``size`` most frequent ids of this cache (``data.draft_vocab``)."""
        return draft_vocab(self.token_counts(n_vocab), size, always)


def _entry(name: str, tokens: int, n_prompt: int, source: str, temperature: float) -> dict[str, Any]:
    return {"file": name, "tokens": tokens, "n_prompt": n_prompt, "source": source, "temperature": temperature}


def _append_manifest(root: Path, entries: Sequence[dict[str, Any]]) -> None:
    with (root / MANIFEST).open("a") as f:
        f.writelines(json.dumps(e) + "\n" for e in entries)


def _sync_manifest(root: Path, files: Sequence[Path]) -> dict[str, dict[str, Any]]:
    """The manifest's entries by file name (a later line for a file wins; a line cut by a crash is
    skipped); entries of ``files`` it lacks are read from the files and appended."""
    entries: dict[str, dict[str, Any]] = {}
    path = root / MANIFEST
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        entries[e["file"]] = e
    missing = [FeatureCache.describe(f) for f in files if f.name not in entries]
    if missing:
        _append_manifest(root, missing)
        entries |= {e["file"]: e for e in missing}
    return entries


def _generated_plan(generated: Sequence[Generated]) -> dict[str, Any]:
    """The plan entries of pre-generated sequences: their count and a digest of their prompts, mix and
    sources (not the replies: float rounding may change them between machines; those stay)."""
    return {"generated_last": True, "n_generated": len(generated),
            "generated_prompts": _digest([(g.prompt, g.temperature, g.source) for g in generated])}


def _grows(have: dict[str, Any], want: dict[str, Any], generated: Sequence[Generated]) -> bool:
    """Whether the cache planned as ``have`` holds a prefix of ``generated``, all else equal."""
    n = have.get("n_generated", 0)
    if not have.get("generated_last") or not 0 < n <= len(generated):
        return False
    return have == want | _generated_plan(generated[:n])


def _digest(value: Any) -> str:
    """A short fingerprint of a JSON-serialisable value."""
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]


def _save(path: Path, **arrays: Any) -> None:
    """Write one sequence file atomically (temp file + rename)."""
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def build_cache(backend: Any, root: str | Path, plan: CachePlan, texts: Sequence[str],
                prompts: Sequence[str] = (), progress: Callable[[int, int], None] | None = None,
                generator: Any = None, generated: Sequence[Generated] = ()) -> FeatureCache:
    """Fill ``root`` with the features and soft labels of the target's greedy continuations of
    ``prompts``, of ``texts`` (cut into ``plan.seq_len``-token windows) and of the ``generated``
    sequences, in that order; resumes a partial cache (files already written are skipped) and grows
    one whose generated sequences are a prefix of ``generated`` (more ``--gen-prompts``: only the new
    ones are evaluated).

    Args:
        backend: a ``LlamaFeatureBackend`` on the target (its context must hold
            ``seq_len`` and ``prompt + gen_tokens`` tokens, and every generated sequence).
        root: cache directory (created).
        plan: the cache's identity; a directory holding another plan is refused (so is one holding
            more generated sequences than ``generated``, or others).
        texts: corpus chunks.
        prompts: training prompts for greedy generations made here, one at a time.
        progress: called as ``progress(done, total)`` after each sequence.
        generator: a plain backend of the same target for the greedy generations of ``prompts`` (a
            capturing backend pays for its capture on every one-token step); the finished sequence is
            then evaluated once on ``backend``. Default: ``backend`` itself.
        generated: finished sequences (``generate.self_distill``), each evaluated once on ``backend``.

    Returns:
        The cache.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    meta_path = root / "meta.json"
    want = asdict(plan) | {"layers": list(backend.feature_layers), "n_embd": backend.n_embd}
    if prompts and not backend.metadata("tokenizer.chat_template"):
        want["base_prompt"] = BASE_PROMPT  # caches of raw prompts (before it) are refused
    if generated:  # absent otherwise: caches from before them keep their plan
        want |= _generated_plan(generated)
    have = json.loads(meta_path.read_text()) if meta_path.exists() else None
    if have is not None and have != want and not _grows(have, want, generated):
        diff = sorted(k for k in want.keys() | have.keys() if have.get(k) != want.get(k))
        raise ValueError(f"{root} holds a feature cache of another plan (differs in {', '.join(diff)}); "
                         "use another directory or delete it")
    if have != want:
        meta_path.write_text(json.dumps(want, indent=1))
    jobs: list[tuple[str, Any]] = [("prompt", p) for p in prompts]
    for text in texts:
        jobs += [("tokens", w) for w in _windows(backend.tokenize(text), plan.seq_len)]
    jobs += [("generated", g) for g in generated]  # last, so that more of them keep every index before
    cache = FeatureCache(root)
    _sync_manifest(root, cache.files())
    for i, (kind, item) in enumerate(jobs):
        out = root / f"seq_{i:05d}.npz"
        if out.exists() and kind == "prompt":
            with np.load(out) as z:
                missing = "n_prompt" not in z.files
                arrays = {k: z[k] for k in z.files} if missing else {}
            if missing:  # written before n_prompt was recorded: add it (tokenizing only)
                _save(out, **arrays, n_prompt=np.int32(len(chat_tokens(backend, item))))
                _append_manifest(root, [FeatureCache.describe(out)])
        if not out.exists():
            tokens, n_prompt, source, temperature = _sequence(backend, generator, plan, kind, item)
            backend.truncate(0)
            logits = backend.eval(tokens, rows="all")  # (L, V): features and labels of the whole sequence
            feats, scale = pack_features(backend.features(0, len(tokens)))
            ids, lp = top_k_logprobs(logits, plan.top_k)
            _save(out, tokens=np.asarray(tokens, np.int32), feats=feats, feat_scale=scale, top_ids=ids, top_lp=lp,
                  n_prompt=np.int32(n_prompt), source=np.str_(source), temperature=np.float64(temperature))
            _append_manifest(root, [_entry(out.name, len(tokens), n_prompt, source, temperature)])
        if progress:
            progress(i + 1, len(jobs))
    backend.truncate(0)
    return cache


def _sequence(backend: Any, generator: Any, plan: CachePlan, kind: str,
              item: Any) -> tuple[list[int], int, str, float]:
    """One job's tokens, prompt length, source and temperature; a ``prompt`` job is generated here."""
    if kind == "tokens":
        return list(item), 0, "corpus", 0.0
    if kind == "generated":
        return [*item.prompt, *item.reply], len(item.prompt), item.source, float(item.temperature)
    tokens = chat_tokens(backend, item)
    n_prompt = len(tokens)
    gen = generator or backend
    gen.truncate(0)
    row = gen.eval(tokens, rows="last")[-1]
    for _ in range(plan.gen_tokens):
        nxt = int(np.argmax(row))
        if gen.is_eog(nxt) or len(tokens) >= plan.seq_len:
            break
        tokens.append(nxt)
        row = gen.eval([nxt], rows="last")[-1]
    gen.truncate(0)
    return tokens, n_prompt, "prompt", 0.0
