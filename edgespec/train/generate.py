"""Batched self-distillation: the target's own replies to many training prompts, ``n_seq`` sequences
at a time on one llama.cpp context.

``BatchGenerator`` is a llama.cpp target whose context holds ``n_seq`` sequences, each in its own KV
stream (``kv_unified`` off: a sequence attends over its own cells only, as in a one-sequence
context). Every step is ONE ``llama_decode`` carrying the next token of every live sequence (seq id
= slot). A sequence ends at an end-of-generation token or a token cap; its slot is then cleared
(``llama_memory_seq_rm``) and refilled with the next prompt, whose prompt is evaluated in a decode of
its own (the shape a one-sequence run gives it), so the batch stays full.

Each sequence is greedy or sampled at a temperature in [0.7, 1.0], drawn by ``sampling_mix`` from a
seed; a sampled sequence draws from its own generator ``default_rng([seed, index])``, so its reply
does not depend on which slot or step it ran in. Prompts are generated ones rendered by
``features.chat_tokens`` (``chat_prompts``) or continuation windows of the corpus (``corpus_prompts``);
``self_distill`` can append finished sequences to a JSON-lines file and resume from it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgespec.backends.llama_cpp import LlamaCppBackend
from edgespec.errors import BackendError, ContextOverflowError
from edgespec.sampling import SamplingParams, process, sample
from edgespec.train.features import Generated, chat_tokens
from edgespec.train.prompt_gen import TrainPrompt

T_RANGE = (0.7, 1.0)


@dataclass
class _Job:
    prompts: Sequence[Sequence[int]]
    temperatures: Sequence[float]
    max_new: int
    cap: int  # most prompt + reply tokens
    seed: int
    todo: Iterator[int]  # indices of the prompts not started yet

    def full(self, slot: _Slot) -> bool:
        return len(slot.reply) >= self.max_new or len(slot.prompt) + len(slot.reply) >= self.cap


@dataclass
class _Slot:
    index: int  # the prompt's position in the caller's list
    prompt: list[int]
    rng: np.random.Generator
    temperature: float
    reply: list[int] = field(default_factory=list)


class BatchGenerator(LlamaCppBackend):
    """A llama.cpp target that generates ``n_seq`` replies at once (module docstring).

    Args:
        path: GGUF file of the target.
        n_seq: parallel sequences (llama.cpp ``n_seq_max``).
        seq_ctx: context of each sequence in tokens (a multiple of 256; prompt + reply must fit).
        threads: CPU threads.
        n_batch: most tokens per prompt decode (longer prompts are chunked).
        kv_type: KV cache type (``LlamaCppBackend``).
        verbose: print llama.cpp's log.

    Generate with ``replies``; the inherited one-sequence ``eval``/``truncate`` would share sequence 0
    with it, so use them on a plain ``LlamaCppBackend`` instead.
    """

    def __init__(self, path: str | os.PathLike, *, n_seq: int = 8, seq_ctx: int = 1024, threads: int | None = None,
                 n_batch: int = 512, kv_type: str = "auto", verbose: bool = False) -> None:
        if n_seq < 1 or seq_ctx < 1 or seq_ctx % 256:
            raise ValueError(f"n_seq must be >= 1 and seq_ctx a positive multiple of 256 (got {n_seq}, {seq_ctx})")
        self.n_seq, self.seq_ctx = n_seq, seq_ctx
        self._step_batch: Any = None
        super().__init__(path, n_ctx=n_seq * seq_ctx, threads=threads, n_batch=n_batch, kv_type=kv_type,
                         verbose=verbose)
        if self.recurrent:
            self.close()
            raise BackendError(f"batched generation needs an attention-only target; {path} has recurrent layers")
        self._step_batch = self._ll.llama_batch_init(max(n_batch, n_seq), 0, 1)

    def _configure_context(self, cp: Any) -> None:
        cp.n_seq_max = self.n_seq
        cp.kv_unified = False

    def close(self) -> None:
        if self.__dict__.get("_step_batch") is not None:
            self._ll.llama_batch_free(self._step_batch)
            self._step_batch = None
        super().close()

    def replies(self, prompts: Sequence[Sequence[int]], temperatures: Sequence[float], max_new: int,
                max_len: int | None = None, seed: int = 0, skip: frozenset[int] = frozenset()
                ) -> Iterator[tuple[int, list[int]]]:
        """The target's replies to tokenized prompts, yielded as ``(index, reply ids)`` when each ends.

        Args:
            prompts: token ids of each rendered prompt.
            temperatures: per prompt, 0 for greedy or the sampling temperature.
            max_new: most reply tokens.
            max_len: most prompt + reply tokens (default: no cap beyond ``max_new``).
            seed: sampled sequence i draws from ``default_rng([seed, i])``.
            skip: indices not to generate (already done).

        Raises:
            ContextOverflowError: a prompt and its reply cap do not fit ``seq_ctx``.
        """
        if len(temperatures) != len(prompts):
            raise ValueError(f"one temperature per prompt (got {len(temperatures)} for {len(prompts)} prompts)")
        job = _Job(prompts, temperatures, max_new, max_len if max_len is not None else 1 << 30, seed,
                   iter([i for i in range(len(prompts)) if i not in skip]))
        slots: list[_Slot | None] = [None] * self.n_seq
        for s in range(self.n_seq):
            slots[s] = yield from self._fill(s, job)
        while any(slots):
            live = [(s, slot) for s, slot in enumerate(slots) if slot is not None]
            rows = self._decode_entries([(s, slot.reply[-1], len(slot.prompt) + len(slot.reply) - 1) for s, slot in live],
                                [True] * len(live))  # (n_live, V)
            for (s, slot), row in zip(live, rows):
                nxt = _choose(row, slot)
                if not self.is_eog(nxt):
                    slot.reply.append(nxt)
                    if not job.full(slot):
                        continue
                yield slot.index, slot.reply
                slots[s] = yield from self._fill(s, job)

    def _fill(self, s: int, job: _Job) -> Generator[tuple[int, list[int]], None, _Slot | None]:
        """Clear sequence ``s`` and start the next prompt in it; prompts that end at once are yielded.
        Returns the new slot (None when no prompt is left)."""
        for i in job.todo:
            # cleared before every prompt: one whose reply ends at its first token leaves its KV here
            if not self._ll.llama_memory_seq_rm(self._mem, s, -1, -1):
                raise BackendError(f"llama_memory_seq_rm could not clear sequence {s}")
            prompt = list(job.prompts[i])
            if not prompt:
                raise ValueError(f"prompt {i} has no tokens")
            if len(prompt) + min(job.max_new, max(job.cap - len(prompt), 0)) > self.seq_ctx:
                raise ContextOverflowError(f"prompt {i} ({len(prompt)} tokens) and up to {job.max_new} reply tokens "
                                           f"do not fit seq_ctx={self.seq_ctx}")
            slot = _Slot(i, prompt, np.random.default_rng([job.seed, i]), float(job.temperatures[i]))
            if len(prompt) < job.cap and job.max_new > 0:
                nxt = _choose(self._prefill(s, prompt), slot)
                if not self.is_eog(nxt):
                    slot.reply.append(nxt)
                    if not job.full(slot):
                        return slot
            yield i, slot.reply
        return None

    def _prefill(self, s: int, prompt: Sequence[int]) -> np.ndarray:
        """Evaluate a prompt in sequence ``s``; the logits (V,) after its last token."""
        entries = [(s, t, pos) for pos, t in enumerate(prompt)]
        for start in range(0, len(entries), self.n_batch):
            chunk = entries[start:start + self.n_batch]
            rows = self._decode_entries(chunk, [start + j == len(entries) - 1 for j in range(len(chunk))])
        return rows[-1]

    def _decode_entries(self, entries: Sequence[tuple[int, int, int]], want: Sequence[bool]) -> np.ndarray:
        """llama_decode of ``(seq id, token, position)`` entries; logits (k, V) of the wanted ones."""
        ll, b = self._ll, self._step_batch
        b.n_tokens = len(entries)
        for j, (s, tok, pos) in enumerate(entries):
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = tok, pos, 1, want[j]
            b.seq_id[j][0] = s
        rc = ll.llama_decode(self.llama_context, b)
        if rc != 0:
            raise BackendError(f"llama_decode returned {rc} for a batch of {len(entries)} tokens")
        k = sum(want)
        if not k:
            return np.empty((0, self.n_vocab), np.float32)
        return self._logit_rows(k).copy()  # rows of the wanted tokens, in batch order


def _choose(row: np.ndarray, slot: _Slot) -> int:
    if slot.temperature == 0.0:
        return int(np.argmax(row))
    return sample(process(row, SamplingParams(temperature=slot.temperature)), slot.rng)


def sampling_mix(n: int, seed: int = 0, greedy_share: float = 0.5,
                 t_range: tuple[float, float] = T_RANGE) -> list[float]:
    """Per sequence, 0.0 (greedy) with probability ``greedy_share``, else a temperature drawn
    uniformly from ``t_range`` (rounded to 2 decimals, so the recorded mix is readable). Prefix-stable:
    sequence i's draw is row i of one (n, 2) draw, so ``sampling_mix(n)[:m] == sampling_mix(m)`` and a
    run with more prompts reuses the replies already generated (``self_distill``'s file)."""
    if not 0.0 <= greedy_share <= 1.0 or not 0.0 < t_range[0] <= t_range[1]:
        raise ValueError(f"greedy_share must be in [0, 1] and t_range positive (got {greedy_share}, {t_range})")
    u = np.random.default_rng([seed, 1_000_003]).random((n, 2))
    temps = np.round(t_range[0] + (t_range[1] - t_range[0]) * u[:, 1], 2)
    return [0.0 if g < greedy_share else float(t) for g, t in zip(u[:, 0], temps)]


def chat_prompts(gen: BatchGenerator, prompts: Sequence[TrainPrompt]) -> tuple[list[list[int]], list[str]]:
    """Generated prompts (``prompt_gen``) rendered as the runtime shows them (``features.chat_tokens``),
    and their sources ``gen:<category>``."""
    return [chat_tokens(gen, p.turns) for p in prompts], [f"gen:{p.category}" for p in prompts]


def corpus_prompts(gen: BatchGenerator, texts: Sequence[str], prefix: int = 64,
                   seq_len: int = 256) -> tuple[list[list[int]], list[str]]:
    """Continuation prompts from corpus text: the first ``prefix`` tokens of each ``seq_len``-token
    window of every text (BOS first where the target adds one), and their source ``gen:corpus``."""
    out: list[list[int]] = []
    for text in texts:
        tokens = gen.tokenize(text)
        for s in range(0, len(tokens) - prefix + 1, seq_len):
            window = tokens[s:s + prefix]
            if gen.add_bos and gen.bos_id is not None and window[0] != gen.bos_id:
                window = [gen.bos_id, *window[:-1]]
            out.append(window)
    return out, ["gen:corpus"] * len(out)


def self_distill(gen: BatchGenerator, prompts: Sequence[Sequence[int]], sources: Sequence[str],
                 max_new: int, max_len: int | None = None, seed: int = 0, greedy_share: float = 0.5,
                 out: str | Path | None = None, progress: Callable[[int, int], None] | None = None) -> list[Generated]:
    """The target's replies to training prompts, batched on ``gen``, in prompt order.

    Args:
        gen: the target.
        prompts: token ids of each prompt (``chat_prompts``, ``corpus_prompts``).
        sources: per prompt, what it is (recorded with the sequence, e.g. ``gen:code``).
        max_new: most reply tokens.
        max_len: most prompt + reply tokens.
        seed: the greedy/temperature mix and the sampling (``sampling_mix``, ``BatchGenerator.replies``).
        greedy_share: share of greedy sequences.
        out: a JSON-lines file the finished sequences are appended to as they end; those already in it
            (same index, prompt and temperature) are read back instead of generated, so an
            interrupted run resumes.
        progress: called as ``progress(done, total)`` as sequences finish.

    Returns:
        One ``Generated`` per prompt.
    """
    if len(sources) != len(prompts):
        raise ValueError(f"one source per prompt (got {len(sources)} for {len(prompts)} prompts)")
    tokens = [list(p) for p in prompts]
    temps = sampling_mix(len(prompts), seed, greedy_share)
    done: dict[int, list[int]] = {}
    path = Path(out) if out is not None else None
    text = path.read_text() if path is not None and path.exists() else ""
    if text:
        for line in text.splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut by an interruption
                continue
            i = rec["index"]
            if i < len(prompts) and rec["prompt"] == tokens[i] and rec["temperature"] == temps[i]:
                done[i] = rec["reply"]
    sink = path.open("a") if path is not None else None
    if sink is not None and text and not text.endswith("\n"):
        sink.write("\n")  # end the cut line, so the next record starts a line of its own
    try:
        for i, reply in gen.replies(tokens, temps, max_new, max_len, seed, frozenset(done)):
            done[i] = reply
            if progress is not None:
                progress(len(done), len(prompts))
            if sink is not None:
                sink.write(json.dumps({"index": i, "prompt": tokens[i], "reply": reply,
                                       "temperature": temps[i], "source": sources[i]}) + "\n")
                sink.flush()
    finally:
        if sink is not None:
            sink.close()
    return [Generated(tokens[i], done[i], temps[i], sources[i]) for i in range(len(prompts))]
