"""Recurrent and hybrid targets on llama.cpp: checkpoint/truncate is exact, and greedy
speculative decoding on them equals plain decoding, with n-gram and draft-model drafters.

Fixtures: tests/recurrent_fixtures.py (a Mamba-2 and an LFM2 hybrid with random weights).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from recurrent_fixtures import ARCHS, recurrent_ggufs  # noqa: F401 (a fixture)

from edgespec.backends.llama_cpp import LlamaCppBackend
from edgespec.backends.llama_features import LlamaFeatureBackend
from edgespec.drafters.draft_model import DraftModelDrafter
from edgespec.drafters.ngram import NgramDrafter
from edgespec.engine import Engine
from edgespec.errors import BackendError

PROMPT_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "Once upon a time, in a small village by the sea,",
    "Q: What is the capital of France?\nA:",
    "1, 2, 3, 4, 5, 6, 7, 8,",
)


def _backend(path: Path) -> LlamaCppBackend:
    return LlamaCppBackend(path, n_ctx=1024, threads=1)


def _next_logits(path: Path, batches: list[list[int]], probe: int) -> np.ndarray:
    """A fresh backend's logits for `probe` after evaluating `batches` (one eval each)."""
    with _backend(path) as b:
        for batch in batches:
            if batch:
                b.eval(batch, rows="none")
        return b.eval([probe], rows="last")


@pytest.fixture(params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


def test_recurrent_flag(recurrent_ggufs, tiny_target):  # noqa: F811
    for a in ARCHS:
        with _backend(recurrent_ggufs[a][0]) as b:
            assert b.recurrent, a
    with _backend(tiny_target) as b:
        assert not b.recurrent


def test_truncate_restores_the_checkpoint_exactly(recurrent_ggufs, arch):  # noqa: F811
    """After prompt + checkpoint + k tokens, truncate(n) for c < n < c+k, n == c, and several times
    after one checkpoint, the next logits equal (bit for bit) a fresh backend's that evaluated the
    same batches: the replay re-evaluates tokens c..n as one batch, as the fresh one does."""
    path = recurrent_ggufs[arch][0]
    rng = np.random.default_rng(1)
    with _backend(path) as b:
        prompt = [int(t) for t in rng.integers(0, b.n_vocab, 12)]
        extra = [int(t) for t in rng.integers(0, b.n_vocab, 8)]
        b.eval(prompt, rows="none")
        c = b.n_past
        b.checkpoint()
        b.eval(extra, rows="all")
        for n_kept in (5, 1, 7, 0, 3, 3):  # n - c, all after the one checkpoint
            b.truncate(c + n_kept)
            assert b.n_past == c + n_kept
            got = b.eval([11], rows="last")
            want = _next_logits(path, [prompt, extra[:n_kept]], 11)
            assert np.array_equal(got, want), (arch, n_kept, float(np.abs(got - want).max()))
            b.truncate(c + n_kept)  # drop the probe: a rollback past what was replayed
            b.eval(extra[n_kept:], rows="none")
            assert b.n_past == c + len(extra)


def test_a_new_checkpoint_replaces_the_old_one(recurrent_ggufs, arch):  # noqa: F811
    path = recurrent_ggufs[arch][0]
    with _backend(path) as b:
        b.eval(list(range(100, 110)), rows="none")
        b.checkpoint()
        b.eval(list(range(200, 204)), rows="none")
        b.checkpoint()
        b.eval(list(range(300, 303)), rows="none")
        b.truncate(15)
        got = b.eval([11], rows="last")
        with pytest.raises(BackendError, match="checkpoint at or before 12 .* the last one is at 14"):
            b.truncate(12)
        assert b.n_past == 16  # refused before anything changed
    want = _next_logits(path, [list(range(100, 110)), list(range(200, 204)), [300]], 11)
    assert np.array_equal(got, want)


def test_a_checkpoint_at_zero_tokens(recurrent_ggufs, arch):  # noqa: F811
    path = recurrent_ggufs[arch][0]
    with _backend(path) as b:
        b.checkpoint()  # an empty state: the buffer grows at the next, larger checkpoint
        b.eval(list(range(100, 110)), rows="none")
        b.truncate(3)
        got = b.eval([11], rows="last")
    assert np.array_equal(got, _next_logits(path, [list(range(100, 103))], 11))


def test_truncate_without_a_checkpoint_is_a_one_line_error(recurrent_ggufs, arch):  # noqa: F811
    with _backend(recurrent_ggufs[arch][0]) as b:
        b.eval(list(range(100, 120)), rows="none")
        with pytest.raises(BackendError) as err:
            b.truncate(10)
        msg = str(err.value)
        assert "\n" not in msg and "from 20 to 10" in msg and "none was taken" in msg
        assert b.n_past == 20
        b.truncate(20)  # to n_past (or beyond): nothing to do, no checkpoint needed
        assert b.n_past == 20


def test_truncate_to_zero_always_works_and_clears_the_checkpoint(recurrent_ggufs, arch):  # noqa: F811
    path = recurrent_ggufs[arch][0]
    prompt = list(range(500, 516))
    with _backend(path) as b:
        b.eval(prompt[:4], rows="none")
        b.checkpoint()
        b.eval(prompt[4:], rows="none")
        b.truncate(0)
        assert b.n_past == 0
        b.eval(prompt, rows="none")
        got = b.eval([11], rows="last")
        with pytest.raises(BackendError, match="none was taken"):
            b.truncate(4)  # the checkpoint went with truncate(0)
    assert np.array_equal(got, _next_logits(path, [prompt], 11))


def test_attention_only_models_roll_back_without_checkpoints(tiny_target):
    prompt, extra = list(range(100, 112)), list(range(200, 206))
    with _backend(tiny_target) as b:
        b.checkpoint()  # a no-op
        b.eval(prompt + extra, rows="none")
        b.truncate(len(prompt) + 2)
        assert b.n_past == len(prompt) + 2
        got = b.eval([11], rows="last")
    assert np.array_equal(got, _next_logits(tiny_target, [prompt + extra[:2]], 11))


def test_feature_heads_refuse_a_recurrent_target(recurrent_ggufs):  # noqa: F811
    with pytest.raises(BackendError, match="'lfm2' has recurrent layers"):
        LlamaFeatureBackend(recurrent_ggufs["lfm2"][0], layers=(1, 2), n_ctx=256, threads=1)


# -- the engine: greedy speculative == plain --------------------------------------------------------


def _prompts(engine: Engine, rounds: int = 3) -> list[list[int]]:
    """P + G₁ + P + G₂ + P + G₃ + P for each text P, each G the target's own greedy continuation (16
    tokens) of all before it: after the last P the model mostly repeats the latest G, so n-gram drafts
    (copied from it) are accepted in full, in part or not at all. (Measured: one round gives the
    LFM2 hybrid, whose attention sees the first G too, 6 n-gram drafts in 5 prompts, three give 15.)"""
    out = []
    for text in PROMPT_TEXTS:
        p = engine.target.tokenize(text)
        prompt = list(p)
        for _ in range(rounds):
            prompt += engine.generate(prompt, max_tokens=16, speculative=False).tokens + p
        out.append(prompt)
    return out


@pytest.mark.parametrize("gamma", [4, "auto"])
@pytest.mark.parametrize("drafter", ["ngram", "draft-model"])
def test_greedy_speculative_equals_plain(recurrent_ggufs, arch, drafter, gamma):  # noqa: F811
    """5 prompts × 64 tokens, token for token. At γ = 4 the drafts are accepted in full and in part
    (so the target rolls back by checkpoint, and a recurrent draft model does too). With "auto" the
    scheduler plans the cycles; on these f32 models it mostly declines (measured T(2) ≈ 2-6 × T(1)
    on a 2-core CPU, and a draft model as costly as the target), so only equality is asserted."""
    target_path, draft_path = recurrent_ggufs[arch]
    target = _backend(target_path)
    d = NgramDrafter() if drafter == "ngram" else DraftModelDrafter(_backend(draft_path), target.n_vocab)
    with Engine(target, d, num_draft=gamma) as engine:
        if gamma == "auto":
            engine.calibrate()  # priced now, not learned from a first plain reply (#48: test_first_use.py)
        full = partial = rollbacks = 0
        for prompt in _prompts(engine):
            plain = engine.generate(prompt, max_tokens=64, speculative=False)
            spec = engine.generate(prompt, max_tokens=64)
            assert spec.tokens == plain.tokens, (arch, drafter, gamma, prompt)
            assert len(spec.tokens) == 64 or spec.finish_reason == "eos"
            stats = engine.last_stats
            full += sum(1 for k, n in stats.cycles if k > 0 and n == k)
            partial += sum(1 for k, n in stats.cycles if 0 < n < k)
            rollbacks += stats.n_rollbacks
            if gamma == "auto":
                assert stats.n_planned >= stats.n_cycles - 1 > 0  # the last (1-token) cycle needs no plan
        print(f"\n{arch} {drafter} γ={gamma}: {full} full, {partial} partial acceptances, {rollbacks} rollbacks")
        if gamma != "auto":
            assert full > 0 and partial > 0 and rollbacks >= partial
