"""Medusa drafting on llama.cpp (drafters.medusa, backends.llama_hidden; on MLX: test_medusa_mlx.py): the
captured final-norm hidden state is what the target's LM head reads, the drafter's chain is the numpy heads'
(heads.medusa.MedusaHead) on it, greedy speculative decoding through the Engine equals plain greedy, and draft
trees are well formed with the right q rows. A tiny F32 llama and Medusa heads written for it: shared LM head
with small random ResBlocks, and own output matrices."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf_fixtures import build_tiny_llama

import edgespec
from edgespec.backends.llama_cpp import LlamaCppBackend
from edgespec.backends.llama_hidden import LlamaHiddenBackend
from edgespec.drafters.medusa import MedusaDrafter, best_paths, open_medusa
from edgespec.drafters.registry import plan_drafter
from edgespec.errors import EdgespecError
from edgespec.gguf_file import read_gguf
from edgespec.heads.medusa import (
    MedusaConfig,
    MedusaHead,
    output_weight,
    res_bias,
    res_weight,
    write_medusa_gguf,
)
from edgespec.sampling import SamplingParams, process_rows

H, K = 64, 3
PROMPT = "The quick brown fox jumps over the lazy dog. Then"


def _heads(config: MedusaConfig, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    t = {}
    for k in range(config.n_heads):
        for j in range(config.n_layers):
            t[res_weight(k, j)] = (0.3 * rng.standard_normal((H, H)) / np.sqrt(H)).astype(np.float32)
            t[res_bias(k, j)] = (0.1 * rng.standard_normal(H)).astype(np.float32)
        if not config.shared_lm_head:
            t[output_weight(k)] = (rng.standard_normal((config.n_vocab, H)) / np.sqrt(H)).astype(np.float32)
    return t


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("medusa")
    target = build_tiny_llama(d / "target.gguf", vocab_source=smollm2_path, n_embd=H)
    n_vocab = read_gguf(target).tensors["output.weight"][1][0]
    out = {"target": target}
    for name, (layers, shared) in {"shared": (1, True), "own": (2, False)}.items():
        config = MedusaConfig(K, layers, H, n_vocab, shared_lm_head=shared)
        out[name] = write_medusa_gguf(d / f"{name}.gguf", config, _heads(config, seed=layers),
                                      vocab_source=target, weight_type="f32")
    return out


@pytest.fixture(scope="module")
def lm_head(files: dict[str, Path]) -> np.ndarray:
    return read_gguf(files["target"]).tensor("output.weight")  # (V, H), read with the gguf package


@pytest.fixture(scope="module")
def target(files: dict[str, Path]):
    with LlamaHiddenBackend(files["target"], n_ctx=256, threads=1) as t:
        yield t


def _fresh(target: LlamaHiddenBackend, tokens: list[int]) -> None:
    target.truncate(0)
    target.eval(tokens, rows="all")


def test_hidden_state_is_what_the_lm_head_reads_and_logits_are_unchanged(files, lm_head, target):
    tokens = target.tokenize(PROMPT)
    target.truncate(0)
    logits = target.eval(tokens, rows="all")
    h = np.stack([target.hidden(p) for p in range(len(tokens))])
    got = h.astype(np.float64) @ lm_head.T.astype(np.float64)
    assert np.abs(got - logits).max() <= 1e-4 * float(logits.max() - logits.min())
    with LlamaCppBackend(files["target"], n_ctx=256, threads=1) as plain:
        assert np.array_equal(plain.eval(tokens, rows="all"), logits)  # capture changes no logit, bit for bit
        plain.truncate(0)
        plain.eval(tokens[:-3], rows="none")  # the prompt's last row is an output on the hidden target only
        target.truncate(0)
        target.eval(tokens[:-3], rows="none")
        assert target.hidden(len(tokens) - 4) is not None and target.hidden(len(tokens) - 5) is None
        assert np.array_equal(plain.eval(tokens[-3:], rows="all"), target.eval(tokens[-3:], rows="all"))
    with LlamaHiddenBackend(files["target"], n_ctx=256, threads=1, compiled=False) as py:
        py.eval(tokens, rows="all")
        assert np.array_equal(np.stack([py.hidden(p) for p in range(len(tokens))]), h)  # C == Python callback
    target.truncate(0)  # rows="last": only the last position's row; rolled back rows are gone
    last = target.eval(tokens, rows="last")
    assert [target.hidden(p) is None for p in range(len(tokens))] == [True] * (len(tokens) - 1) + [False]
    h_last = target.hidden(len(tokens) - 1).astype(np.float64)  # another batch shape: equal up to rounding
    assert np.abs(h_last - h[-1]).max() < 1e-4 and np.abs(h_last @ lm_head.T - last[0]).max() < 1e-3
    target.truncate(len(tokens) - 1)
    assert target.hidden(len(tokens) - 1) is None


@pytest.mark.parametrize("kind", ["shared", "own"])
def test_chain_is_the_numpy_heads_on_h(kind, files, lm_head, target):
    drafter = open_medusa(files[kind], target)
    oracle = MedusaHead.from_gguf(files[kind], lm_head=lm_head if kind == "shared" else None)
    tokens = target.tokenize(PROMPT)
    _fresh(target, tokens[:-1])  # the engine's state: the last context token pending
    h = target.hidden(len(tokens) - 2)
    ref = oracle.logits(h[None])[:, 0]  # (K, V)
    rng = np.random.default_rng(0)
    greedy = drafter.draft(tokens, 5, SamplingParams(temperature=0.0), rng)
    assert greedy.tokens == [int(np.argmax(r)) for r in ref] and greedy.q is None
    assert drafter.draft(tokens, 2, SamplingParams(temperature=0.0), rng).tokens == greedy.tokens[:2]
    params = SamplingParams(temperature=0.8, top_k=40)
    sampled = drafter.draft(tokens, K, params, rng)
    want = np.stack([process_rows(r[None], params)[0].dense() for r in ref])
    assert sampled.q is not None and np.abs(sampled.q - want).max() < 1e-5
    assert all(sampled.q[i, t] > 0 for i, t in enumerate(sampled.tokens))
    assert drafter.draft(tokens[:1], 3, params, rng).tokens == []  # nothing evaluated yet: no draft
    target.truncate(0)
    target.eval(tokens[:-1], rows="none")  # as the engine prefills a prompt: the first cycle drafts
    assert drafter.draft(tokens, 5, SamplingParams(temperature=0.0), rng).tokens == greedy.tokens
    assert drafter.cost_prior().per_token_ms > 0


def _memorised(path: Path, target: LlamaHiddenBackend, seq: list[int], n_vocab: int) -> Path:
    """Heads with own outputs and no ResBlocks that recall `seq`: W_k = sum over p of onehot(seq[p+2+k]) h_p^T
    (h_p: the target's rows of `seq`), so that drafts along `seq` get accepted, but for the last head's."""
    _fresh(target, seq)
    h = np.stack([target.hidden(p) for p in range(len(seq))])
    h /= np.linalg.norm(h, axis=1, keepdims=True)
    tensors = {}
    for k in range(K):
        w = np.zeros((n_vocab, H), np.float32)
        off = 2 + k if k < K - 1 else 1  # the last head recalls the wrong token: cycles accept part of a draft
        for p in range(len(seq) - off):
            w[seq[p + off]] += h[p]
        tensors[output_weight(k)] = w
    return write_medusa_gguf(path, MedusaConfig(K, 0, H, n_vocab), tensors, weight_type="f32")


def test_greedy_speculative_equals_plain_through_the_engine(files, target, tmp_path):
    prompt = target.tokenize(PROMPT)
    with edgespec.load(files["target"], drafter=str(files["shared"]), n_ctx=512, threads=1, num_draft=3) as engine:
        assert isinstance(engine.drafter, MedusaDrafter) and isinstance(engine.target, LlamaHiddenBackend)
        plain = engine.generate(prompt, max_tokens=40, speculative=False)
        spec = engine.generate(prompt, max_tokens=40)
        assert spec.tokens == plain.tokens and spec.stats.n_drafted > 0
    heads = _memorised(tmp_path / "recall.gguf", target, prompt + plain.tokens, target.n_vocab)
    with edgespec.load(files["target"], drafter=str(heads), n_ctx=512, threads=1, num_draft=3) as engine:
        stats = []
        for p in (prompt, "Once upon a time"):
            plain = engine.generate(p, max_tokens=40, speculative=False)
            spec = engine.generate(p, max_tokens=40)
            assert spec.tokens == plain.tokens, p
            assert spec.stats.n_drafted > 0 and all(d <= 3 for d, _ in spec.stats.cycles)
            stats.append(spec.stats)
    print("accepted of drafted:", [(s.n_accepted, s.n_drafted) for s in stats])
    assert stats[0].n_accepted > stats[0].n_drafted // 2  # recalled: the first K - 1 of each draft accepted
    assert any(0 < a < d for d, a in stats[0].cycles)
    assert stats[1].n_accepted < stats[1].n_drafted  # an unseen prompt: some rejected


def test_plan_refuses_heads_of_another_target(files, tmp_path, smollm2_path):
    assert plan_drafter(files["own"], files["target"]).kind == "medusa"
    narrow = build_tiny_llama(tmp_path / "narrow.gguf", vocab_source=smollm2_path, n_embd=32)
    with pytest.raises(EdgespecError) as e:
        plan_drafter(files["own"], narrow)
    assert "\n" not in str(e.value) and str(files["own"]) in str(e.value) and str(narrow) in str(e.value)
    small = write_medusa_gguf(tmp_path / "small.gguf", MedusaConfig(1, 0, H, 300, True), {}, weight_type="f32")
    with pytest.raises(EdgespecError, match="vocabulary") as e:
        plan_drafter(small, files["target"])
    assert str(small) in str(e.value) and str(files["target"]) in str(e.value)
    assert plan_drafter(files["own"], files["target"], backend="mlx").kind == "medusa"  # test_medusa_mlx.py


@pytest.mark.parametrize("kind", ["shared", "own"])
@pytest.mark.parametrize("greedy", [True, False])
def test_draft_tree(kind, greedy, files, target):
    drafter = open_medusa(files[kind], target)
    tokens = target.tokenize(PROMPT)
    _fresh(target, tokens[:-1])
    params = SamplingParams(temperature=0.0) if greedy else SamplingParams(temperature=1.0, top_k=8)
    rng = np.random.default_rng(1)
    chain = drafter.draft(tokens, K, SamplingParams(temperature=0.0), rng).tokens
    h = target.hidden(len(tokens) - 2)
    logits = [drafter.runner.logits(h, k).astype(np.float64) for k in range(K)]
    for max_nodes in (1, 4, 10, 25):
        tree = drafter.draft_tree(tokens, max_nodes, K, params, rng)
        assert 0 < tree.n_nodes <= max_nodes  # DraftTree itself refuses non-topological or repeated siblings
        assert all(p < i for i, p in enumerate(tree.parents))
        for i in [-1, *range(tree.n_nodes)]:
            kids = [tree.tokens[c] for c in tree.children(i)]
            assert len(set(kids)) == len(kids)
        assert max(tree.depth) <= K
        if greedy:
            assert tree.q is None
            node = -1
            for t in chain[: max(tree.depth)]:  # the first-child chain is the greedy chain
                node = tree.children(node)[0]
                assert tree.tokens[node] == t
            for i in [-1, *range(tree.n_nodes)]:  # siblings in descending probability
                kids = tree.children(i)
                if kids:
                    d = tree.depth[kids[0]] - 1
                    assert all(logits[d][tree.tokens[a]] >= logits[d][tree.tokens[b]] for a, b in zip(kids, kids[1:]))
        else:
            assert tree.q is not None and np.allclose(tree.q.sum(axis=1), 1.0)
            for i, t in enumerate(tree.tokens):
                want = process_rows(logits[tree.depth[i] - 1][None], params)[0].dense()
                assert tree.q[i, t] > 0 and np.abs(tree.q[i] - want).max() < 1e-9
        # confidences are each node's probability at its parent; their products along the paths (the
        # candidates' scores) come best first
        assert tree.confidence is not None
        score: list[float] = []
        for c, par in zip(tree.confidence, tree.parents):
            score.append(c * (score[par] if par >= 0 else 1.0))
        assert all(a >= b for a, b in zip(score, score[1:]))
    assert drafter.draft_tree(tokens[:1], 5, K, params, rng).n_nodes == 0
    assert max(drafter.draft_tree(tokens, 10, 1, params, rng).depth) == 1


def test_best_paths_by_hand():
    probs = [np.array([0.6, 0.3, 0.1]), np.array([0.9, 0.1])]
    paths, scores = best_paths(probs, 4)
    assert paths == [(0,), (0, 0), (1,), (1, 0)] and np.allclose(scores, [0.6, 0.54, 0.3, 0.27])
    assert best_paths(probs, 100)[0] == [(0,), (0, 0), (1,), (1, 0), (2,), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert best_paths([np.array([1.0, 0.0])], 5)[0] == [(0,)]  # zero-probability ranks are never taken


def test_tree_rows_are_kept_for_the_path_a_tree_cycle_keeps(files, target):
    """note_tree / keep_tree_path (the calls a tree cycle makes around llama_tree's eval_tree and keep_path):
    the kept positions' rows are those of the same tokens evaluated as a chain, and the next draft reads them."""
    from edgespec.backends import llama_tree

    tokens = target.tokenize(PROMPT)
    with LlamaHiddenBackend(files["target"], n_ctx=256, threads=1, tree_leaves=8) as t:
        drafter = open_medusa(files["shared"], t)
        for pick in (lambda tree: [tree.children(-1)[0], tree.children(tree.children(-1)[0])[0]],  # first children
                     lambda tree: [tree.children(-1)[1]]):  # a later sibling: re-evaluated in order
            t.truncate(0)
            t.eval(tokens[:-1], rows="last")
            tree = drafter.draft_tree(tokens, 8, K, SamplingParams(temperature=0.0), np.random.default_rng(0))
            llama_tree.eval_tree(t, tokens[-1], tree.tokens, tree.parents)
            t.note_tree(tree.parents)
            path = pick(tree)
            llama_tree.keep_path(t, path)
            t.keep_tree_path(path)
            seq = tokens + [tree.tokens[i] for i in path]
            _fresh(target, seq)
            for p in range(len(tokens) - 1, len(seq)):
                assert np.abs(t.hidden(p) - target.hidden(p)).max() < 1e-3
            assert drafter.draft(seq + [0], K, SamplingParams(temperature=0.0), np.random.default_rng(0)).tokens


def test_greedy_tree_through_the_engine(files, target, tmp_path):
    """Medusa's candidate trees through Engine(tree=8): greedy == plain, and every cycle drafts (the
    hidden row of the kept path is the next cycle's h: backends.trees calls note_tree/keep_tree_path)."""
    prompt = target.tokenize(PROMPT)
    with edgespec.load(files["target"], drafter=None, n_ctx=512, threads=1) as plain_engine:
        plain = plain_engine.generate(prompt, max_tokens=40)
    heads = _memorised(tmp_path / "recall.gguf", target, prompt + plain.tokens, target.n_vocab)
    with edgespec.load(files["target"], drafter=str(heads), n_ctx=512, threads=1, num_draft=3, tree=8) as engine:
        for p in (prompt, "Once upon a time"):
            want = engine.generate(p, max_tokens=40, speculative=False)
            spec = engine.generate(p, max_tokens=40)
            assert spec.tokens == want.tokens, p
            assert spec.stats.tree_cycles >= spec.stats.n_cycles - 1
            assert all(d > 0 for d, _ in spec.stats.cycles[:-1]), spec.stats.cycles  # every cycle drafted
        assert spec.stats.n_accepted < spec.stats.n_drafted


def test_greedy_auto_trees_through_the_engine(files, target):
    """`--tree auto` with (random) Medusa heads, schedule.trees on a flat T(k) so that trees are taken
    while the scheduler still drafts: greedy == plain, token for token."""
    from dataclasses import replace

    from test_tree_auto import FLAT, _scheduler

    from edgespec.schedule.trees import TreeScheduling

    with edgespec.load(files["target"], drafter=str(files["shared"]), n_ctx=512, threads=1, num_draft="auto",
                       tree="auto") as engine:
        prior = replace(engine.drafter.cost_prior(), fixed_ms=0.1, per_token_ms=0.1)
        sched, trees = TreeScheduling(_scheduler(FLAT, prior), 16), 0
        for p in (target.tokenize(PROMPT), "Once upon a time"):
            want = engine.generate(p, max_tokens=40, speculative=False)
            spec = engine.generate(p, max_tokens=40, scheduler=sched)
            assert spec.tokens == want.tokens, p
            trees += spec.stats.tree_cycles
        assert trees > 0


def test_a_published_checkpoint_directory_drafts_as_is(files, target, tmp_path):
    """`--drafter DIR` with a Medusa checkpoint in FasterDecoding's layout: converted once for the
    target (cached under $EDGESPEC_HOME/heads), then drafted with; greedy == plain, chains and trees."""
    from medusa_reference import write_checkpoint

    d = write_checkpoint(tmp_path / "medusa-ckpt", K, 1, H, target.n_vocab, own_output=True, untied=False,
                         dtype="fp32", seed=3)
    for tree in ("off", 8):
        with edgespec.load(files["target"], drafter=str(d), n_ctx=512, threads=1, num_draft=3, tree=tree) as engine:
            assert isinstance(engine.drafter, MedusaDrafter)
            want = engine.generate(PROMPT, max_tokens=24, speculative=False)
            spec = engine.generate(PROMPT, max_tokens=24)
            assert spec.tokens == want.tokens and spec.stats.n_drafted > 0
