"""Training data for heads: disjoint from every evaluation prompt, d2t, top-k soft labels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgespec.train import prompts as P
from edgespec.train.data import (
    NGRAM,
    Forbidden,
    draft_vocab,
    evaluation_texts,
    local_corpus,
    ngrams,
    target_to_draft,
)
from edgespec.train.features import BASE_PROMPT, chat_tokens, top_k_logprobs
from edgespec.train.prompt_gen import CATEGORIES, TrainPrompt, generate_prompts


def test_evaluation_texts_cover_the_bench_suite_and_test_prompts():
    texts = evaluation_texts()
    assert len(texts) > 60  # 60 bench tasks (prompt + messages) and tests/real_prompts.py
    assert any("def fibonacci(n):" in t for t in texts)
    from edgespec.bench.sessions import load_sessions
    from edgespec.bench.spec_bench import load_questions
    held = {load_questions()[-1].prompt, load_sessions("agent-loop")[-1].turns[-1].prompt,
            load_sessions("edit-session")[0].turns[0].messages[-1]["content"]}
    assert held <= set(texts)  # Spec-Bench and the session suites are guarded too


def test_training_prompts_share_no_8gram_with_evaluation_texts():
    forbidden = Forbidden(evaluation_texts())
    for prompt in P.TRAIN_PROMPTS + P.HELDOUT_PROMPTS:
        assert forbidden.clean(prompt), prompt
    assert not set(P.TRAIN_PROMPTS) & set(P.HELDOUT_PROMPTS)
    held = set().union(*(ngrams(p) for p in P.HELDOUT_PROMPTS))
    assert not any(ngrams(p) & held for p in P.TRAIN_PROMPTS)  # held-out prompts are not near-copies


def test_generated_prompts_share_no_8gram_with_evaluation_texts_or_heldout_prompts():
    """Checked here from the n-grams themselves, not through the generator's own filter."""
    banned = set().union(*(ngrams(t) for t in [*evaluation_texts(), *P.HELDOUT_PROMPTS]))
    got = generate_prompts()
    assert len(got) >= 5000 and len(set(got)) == len(got)
    assert {p.category for p in got} == set(CATEGORIES)
    for p in got:
        assert not ngrams("\n".join(p.turns)) & banned, p
        assert len(p.turns) % 2 == 1 and (len(p.turns) > 1) == (p.category == "multi-turn")
    assert not {t for p in got for t in p.turns} & set(P.HELDOUT_PROMPTS)


def test_generated_prompts_are_seeded_and_filtered_by_forbidden():
    first = generate_prompts(300, seed=1)
    assert first == generate_prompts(300, seed=1) and first != generate_prompts(300, seed=2)
    leak = first[5]
    filtered = generate_prompts(300, seed=1, forbidden=Forbidden(["\n".join(leak.turns)]))
    assert leak not in filtered and len(filtered) == 300
    assert all(isinstance(p, TrainPrompt) for p in filtered)


def test_corpus_chunks_share_no_8gram_with_evaluation_texts():
    bench = set().union(*(ngrams(t) for t in evaluation_texts()))
    chunks = list(local_corpus(max_chars=300_000, seed=0))
    assert sum(map(len, chunks)) >= 250_000 and len(chunks) > 50
    for c in chunks:
        assert not ngrams(c) & bench
    assert chunks == list(local_corpus(max_chars=300_000, seed=0))  # reproducible


def test_forbidden_drops_a_chunk_that_quotes_a_bench_prompt(tmp_path):
    quote = evaluation_texts()[0]
    words = quote.split()
    assert len(words) >= NGRAM
    (tmp_path / "doc").mkdir()
    (tmp_path / "doc" / "a.txt").write_text("harmless text line\n" * 20 + " ".join(words[:NGRAM]) + "\n")
    (tmp_path / "doc" / "b.txt").write_text("another harmless line of text\n" * 20)
    got = list(local_corpus(roots=[tmp_path / "doc"]))
    assert len(got) == 1 and got[0].startswith("another")


def test_draft_vocab_most_frequent_sorted_and_t2d_inverts_it():
    counts = np.array([5, 0, 9, 9, 1, 7], np.int64)
    d2t = draft_vocab(counts, 3)
    np.testing.assert_array_equal(d2t, [2, 3, 5])
    np.testing.assert_array_equal(draft_vocab(counts, 3, always=[1]), [1, 2, 3])
    t2d = target_to_draft(d2t, 6)
    np.testing.assert_array_equal(t2d, [-1, -1, 0, 1, -1, 2])


def test_top_k_logprobs_are_the_largest_log_softmax_values():
    x = np.random.default_rng(0).standard_normal((5, 300)).astype(np.float32) * 4
    ids, lp = top_k_logprobs(x, 8)
    ls = x - np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)) - x.max(1, keepdims=True)
    want = np.argsort(-ls, axis=1)[:, :8]
    np.testing.assert_array_equal(ids, want)
    np.testing.assert_allclose(lp.astype(np.float32), np.take_along_axis(ls, want, 1), atol=5e-3)


def test_heldout_bench_file_is_the_heldout_prompts():
    """bench/heldout/heads.jsonl (the head acceptance tables' tasks) holds exactly HELDOUT_PROMPTS."""
    from edgespec.bench.tasks import load_tasks

    tasks = load_tasks(str(Path(__file__).parent.parent / "bench" / "heldout" / "heads.jsonl"))
    assert [t.messages[0]["content"] for t in tasks] == list(P.HELDOUT_PROMPTS)
    assert {t.category for t in tasks} == {"heldout"}
    # a target without a chat template is benched on `prompt`: training frames prompts the same way
    assert [t.prompt for t in tasks] == [BASE_PROMPT.format(p) for p in P.HELDOUT_PROMPTS]


def test_training_prompts_are_framed_as_the_runtime_shows_them():
    """With no chat template, a training prompt is tokenized in BASE_PROMPT's framing (not raw), one
    BASE_PROMPT per user turn of a conversation."""
    class NoTemplate:
        bos_id = None

        def metadata(self, key):
            return None

        def tokenize(self, text, *a, **k):
            return [ord(c) for c in text]

    assert chat_tokens(NoTemplate(), "Why?") == [ord(c) for c in "Question: Why?\nAnswer:"]
    turns = ("Why?", "Because.", "How?")
    assert chat_tokens(NoTemplate(), turns) == [ord(c) for c in "Question: Why?\nAnswer: Because.\nQuestion: How?\nAnswer:"]
    with pytest.raises(ValueError, match="got 2"):
        chat_tokens(NoTemplate(), ("Why?", "Because."))
