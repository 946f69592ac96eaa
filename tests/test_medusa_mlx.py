"""Medusa drafting on MLX (drafters.medusa over backends.mlx_hidden.MlxHiddenBackend): the hidden state the
MLX target keeps is a plain MLX evaluation's final-norm state of that row (chunked, rolled back, and for the
path a draft tree keeps), its logits are unchanged, the drafter's chain is the numpy heads' on it, greedy
speculative output through the Engine equals plain greedy output (chains and forced trees), sampled
generations draft, and the registry plans Medusa for --backend mlx but still refuses heads of another
target in one line. test_medusa_drafter.py's tiny F32 llama (converted to MLX) and heads; marked real (the
GGUF copies SmolLM2's tokenizer)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf_fixtures import build_tiny_llama
from mlx_fixtures import build_tiny_mlx, own_mlx_home  # noqa: F401 (used by pytestmark)
from test_medusa_drafter import PROMPT, H, K, _memorised, files, lm_head  # noqa: F401 (fixtures)

mx = pytest.importorskip("mlx.core", reason="mlx is not installed: pip install 'edgespec[mlx]'")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed: pip install 'edgespec[mlx]'")

import edgespec  # noqa: E402
from edgespec.backends import mlx_tree  # noqa: E402
from edgespec.backends.mlx import MlxBackend  # noqa: E402
from edgespec.backends.mlx_hidden import MlxHiddenBackend  # noqa: E402
from edgespec.backends.reference import ReferenceBackend  # noqa: E402
from edgespec.drafters.medusa import MedusaDrafter, open_medusa  # noqa: E402
from edgespec.drafters.registry import open_backend, open_drafter, plan_drafter  # noqa: E402
from edgespec.errors import EdgespecError  # noqa: E402
from edgespec.heads.medusa import MedusaConfig, MedusaHead, write_medusa_gguf  # noqa: E402
from edgespec.sampling import SamplingParams, process_rows  # noqa: E402

pytestmark = [pytest.mark.real, pytest.mark.usefixtures("own_mlx_home")]
TOL = 1e-3  # of the hidden state's range, as test_mlx_features' feature comparisons


def _rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / (b.max() - b.min()))


def _final_norm(path: Path, tokens: list[int]) -> np.ndarray:
    """A plain MLX evaluation's final-norm hidden states of `tokens` (one forward, no cache): (n, H)."""
    with MlxBackend(path, n_ctx=256) as plain:
        h = plain.model.model(mx.array([tokens]))[0].astype(mx.float32)
        mx.eval(h)
        return np.array(h)


@pytest.fixture(scope="module")
def target(files):  # noqa: F811
    with MlxHiddenBackend(files["target"], n_ctx=256, n_batch=4) as t:
        yield t


def test_hidden_state_is_the_final_norm_row_and_logits_are_unchanged(files, lm_head, target):  # noqa: F811
    tokens = target.tokenize(PROMPT)
    want = _final_norm(files["target"], tokens)
    target.truncate(0)
    target.eval(tokens[:6], rows="none")  # chunks of 4 + 2, no logits
    logits = target.eval(tokens[6:], rows="all")
    assert target.n_embd == H and [target.hidden(p) is None for p in (-1, len(tokens))] == [True, True]
    h = np.stack([target.hidden(p) for p in range(len(tokens))])
    diff = _rel_diff(h, want)
    print(f"MLX hidden rows vs one plain forward's final norm: {diff:.1e} of the range")
    assert h.shape == want.shape and h.dtype == np.float32 and diff <= TOL
    got = h[6:].astype(np.float64) @ lm_head.T.astype(np.float64)  # what the LM head reads
    assert np.abs(got - logits).max() <= 1e-4 * float(logits.max() - logits.min())
    with MlxBackend(files["target"], n_ctx=256, n_batch=4) as plain:  # the tap changes no logit, bit for bit
        plain.eval(tokens[:6], rows="none")
        assert np.array_equal(plain.eval(tokens[6:], rows="all"), logits)
    assert np.abs(target.output_matrix() - lm_head).max() < 1e-6
    target.truncate(5)  # rolled back rows are gone; evaluated again, they are the new tokens'
    assert target.hidden(4) is not None and target.hidden(5) is None
    target.eval([17, 42], rows="last")
    again = _final_norm(files["target"], tokens[:5] + [17, 42])
    assert _rel_diff(np.stack([target.hidden(p) for p in range(7)]), again) <= TOL


@pytest.mark.parametrize("runtime", ["numpy", "mlx"])
@pytest.mark.parametrize("kind", ["shared", "own"])
def test_chain_is_the_numpy_heads_on_h(kind, runtime, files, lm_head, target):  # noqa: F811
    """The heads run in numpy (MedusaRunner, the target's LM head copied) or on MLX (MlxMedusaRunner, the
    target's own LM head called): either's logits are the float64 oracle's on the target's row."""
    drafter = open_medusa(files[kind], target, runtime)
    assert type(drafter.runner).__name__ == {"numpy": "MedusaRunner", "mlx": "MlxMedusaRunner"}[runtime]
    oracle = MedusaHead.from_gguf(files[kind], lm_head=lm_head if kind == "shared" else None)
    tokens = target.tokenize(PROMPT)
    target.truncate(0)
    target.eval(tokens[:-1], rows="last")  # the engine's state: the last context token pending
    ref = oracle.logits(target.hidden(len(tokens) - 2)[None])[:, 0]  # (K, V)
    got = np.stack([drafter.runner.logits(target.hidden(len(tokens) - 2), k) for k in range(K)])
    diff = _rel_diff(got, ref)
    print(f"{kind} heads in {runtime}: logits within {diff:.1e} of the range of the float64 oracle's")
    assert got.dtype == np.float32 and diff <= 1e-5
    rng = np.random.default_rng(0)
    greedy = drafter.draft(tokens, 5, SamplingParams(temperature=0.0), rng)
    assert greedy.tokens == [int(np.argmax(r)) for r in ref] and greedy.q is None
    params = SamplingParams(temperature=0.8, top_k=40)
    sampled = drafter.draft(tokens, K, params, rng)
    want = np.stack([process_rows(r[None], params)[0].dense() for r in ref])
    assert sampled.q is not None and np.abs(sampled.q - want).max() < 1e-5
    tree = drafter.draft_tree(tokens, 8, K, SamplingParams(temperature=0.0), rng)
    assert tree.n_nodes == 8 and tree.tokens[0] == greedy.tokens[0]


def test_tree_rows_are_kept_for_the_path_a_tree_cycle_keeps(files, target):  # noqa: F811
    """mlx_tree.eval_tree notes the tree's rows and keep_path stores the kept path's: they are the rows of
    the same tokens evaluated as a chain, and the next draft reads them."""
    tokens = target.tokenize(PROMPT)
    with MlxHiddenBackend(files["target"], n_ctx=256) as t:  # a tree of 9 rows: one batch of the default 512
        drafter = open_medusa(files["shared"], t)
        for pick in (lambda tree: [tree.children(-1)[0], tree.children(tree.children(-1)[0])[0]],  # first children
                     lambda tree: [tree.children(-1)[1]]):  # a later sibling
            t.truncate(0)
            t.eval(tokens[:-1], rows="last")
            tree = drafter.draft_tree(tokens, 8, K, SamplingParams(temperature=0.0), np.random.default_rng(0))
            mlx_tree.eval_tree(t, tokens[-1], tree.tokens, tree.parents)
            path = pick(tree)
            mlx_tree.keep_path(t, path)
            seq = tokens + [tree.tokens[i] for i in path]
            assert t.n_past == len(seq) and t.hidden(len(seq)) is None
            got = np.stack([t.hidden(p) for p in range(len(seq))])
            diff = _rel_diff(got, _final_norm(files["target"], seq))
            print(f"kept tree path {path}: hidden rows vs a plain forward's {diff:.1e} of the range")
            assert diff <= TOL
            assert drafter.draft(seq + [0], K, SamplingParams(temperature=0.0), np.random.default_rng(0)).tokens


def _engine(target: Path, drafter: Path, tree: int | str, impl: str):
    """edgespec.load(target, drafter, backend="mlx", num_draft=3, tree=tree) with the heads run by `impl`."""
    from edgespec.session import Session, plan

    return Session(plan(target, str(drafter), "mlx", num_draft=3, tree=tree, n_ctx=512), impl=impl).engine


@pytest.mark.parametrize("impl", ["auto", "mlx"])
@pytest.mark.parametrize("tree", ["off", 8])
def test_greedy_speculative_equals_plain_through_the_engine(tree, impl, files, target, tmp_path):  # noqa: F811
    """edgespec.load(..., backend="mlx") with Medusa heads: random heads (shared LM head) and heads that
    recall the target's own continuation (all but the last head's token accepted), chain γ 3 and forced
    8-node trees, the heads run as "auto" picks (numpy on mlx[cpu]) and on MLX."""
    from edgespec.heads.medusa_mlx import mlx_on_gpu

    prompt = target.tokenize(PROMPT)
    runner = "MlxMedusaRunner" if impl == "mlx" or mlx_on_gpu() else "MedusaRunner"
    with edgespec.load(files["target"], drafter=str(files["shared"]), backend="mlx", n_ctx=512, num_draft=3,
                       tree=tree) as engine:
        assert isinstance(engine.drafter, MedusaDrafter) and isinstance(engine.target, MlxHiddenBackend)
        plain = engine.generate(prompt, max_tokens=24, speculative=False)
    with _engine(files["target"], files["shared"], tree, impl) as engine:
        assert type(engine.drafter.runner).__name__ == runner
        spec = engine.generate(prompt, max_tokens=24)
        assert spec.tokens == plain.tokens and spec.stats.n_drafted > 0
    heads = _memorised(tmp_path / "recall.gguf", target, prompt + plain.tokens, target.n_vocab)
    with _engine(files["target"], heads, tree, impl) as engine:
        stats = []
        for p in (prompt, "Once upon a time"):
            want = engine.generate(p, max_tokens=24, speculative=False)
            spec = engine.generate(p, max_tokens=24)
            assert spec.tokens == want.tokens, p
            assert all(d > 0 for d, _ in spec.stats.cycles[:-1]), spec.stats.cycles  # every cycle drafted
            stats.append(spec.stats)
    print(f"tree {tree}, {runner}: accepted of drafted:", [(s.n_accepted, s.n_drafted) for s in stats])
    assert stats[0].n_accepted >= 1.5 * stats[0].n_cycles  # recalled: the first K - 1 of most drafts accepted
    if tree != "off":
        assert stats[0].tree_cycles >= stats[0].n_cycles - 1
    assert stats[1].n_accepted < stats[1].n_drafted  # an unseen prompt: some rejected


@pytest.mark.parametrize("tree", ["off", 8])
def test_sampled_generations_draft(tree, files):  # noqa: F811
    """Sampled speculative decoding with Medusa heads on MLX, chains and trees: every cycle but the last
    drafts and emits at least one token, and the same seed gives the same text."""
    with edgespec.load(files["target"], drafter=str(files["own"]), backend="mlx", n_ctx=512, num_draft=3,
                       tree=tree) as engine:
        runs = [engine.generate(PROMPT, max_tokens=16, temperature=1.0, top_k=8, seed=s) for s in (3, 3)]
    assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) == 16
    assert runs[0].stats.n_drafted > 0 and all(d > 0 for d, _ in runs[0].stats.cycles[:-1])


def test_plan_takes_mlx_and_refuses_heads_of_another_target(files, tmp_path, smollm2_path):  # noqa: F811
    assert plan_drafter(files["own"], files["target"], backend="mlx").kind == "medusa"
    from edgespec.backends.llama_hidden import LlamaHiddenBackend

    with LlamaHiddenBackend(files["target"], n_ctx=64, threads=1) as llama:  # MLX runs heads for MLX targets
        with pytest.raises(EdgespecError, match="MLX target") as e:
            open_medusa(files["own"], llama, "mlx")
        assert "\n" not in str(e.value)
    narrow = build_tiny_llama(tmp_path / "narrow.gguf", vocab_source=smollm2_path, n_embd=32)
    with pytest.raises(EdgespecError) as e:
        plan_drafter(files["own"], narrow, backend="mlx")
    assert "\n" not in str(e.value) and str(files["own"]) in str(e.value) and str(narrow) in str(e.value)
    # an mlx-lm directory has no GGUF header to check at plan time: the sizes are checked when it opens
    d = build_tiny_mlx(tmp_path / "tiny-mlx", n_vocab=6)
    plan = plan_drafter(files["own"], d, backend="mlx")
    with open_backend(d, "mlx", hidden=True, vocab=ReferenceBackend(6)) as t:
        with pytest.raises(EdgespecError, match="hidden size") as e:
            open_drafter(plan, t, "mlx")
        assert "\n" not in str(e.value) and str(files["own"]) in str(e.value) and str(d) in str(e.value)
        small = write_medusa_gguf(tmp_path / "small.gguf", MedusaConfig(1, 0, 32, 300, True), {},
                                  weight_type="f32")
        with pytest.raises(EdgespecError, match="vocabulary"):
            open_drafter(plan_drafter(small, d, backend="mlx"), t, "mlx")


def test_a_published_checkpoint_directory_drafts_on_mlx(files, target, tmp_path):  # noqa: F811
    """`--backend mlx --drafter DIR` with a Medusa checkpoint in FasterDecoding's layout: converted once for
    the GGUF target (as on llama.cpp), then drafted with on MLX; greedy == plain through a forced tree."""
    pytest.importorskip("torch", reason="the checkpoint is written with torch: pip install 'edgespec[train]'")
    from medusa_reference import write_checkpoint

    d = write_checkpoint(tmp_path / "medusa-ckpt", K, 1, H, target.n_vocab, own_output=True, untied=False,
                         dtype="fp32", seed=3)
    with edgespec.load(files["target"], drafter=str(d), backend="mlx", n_ctx=512, num_draft=3, tree=8) as engine:
        assert isinstance(engine.drafter, MedusaDrafter)
        want = engine.generate(PROMPT, max_tokens=16, speculative=False)
        spec = engine.generate(PROMPT, max_tokens=16)
        assert spec.tokens == want.tokens and spec.stats.n_drafted > 0 and spec.stats.tree_cycles > 0


N_VOCAB = 12


def _random_heads(n_embd: int, seed: int) -> tuple[MedusaConfig, dict[str, np.ndarray]]:
    """K heads of one ResBlock sharing the target's LM head, random (as test_medusa_drafter's)."""
    config = MedusaConfig(K, 1, n_embd, N_VOCAB, shared_lm_head=True)
    rng = np.random.default_rng(seed)
    return config, {name: ((0.3 if len(shape) == 2 else 0.1) * rng.standard_normal(shape)
                           / (np.sqrt(n_embd) if len(shape) == 2 else 1.0)).astype(np.float32)
                    for name, shape in config.shapes().items()}


@pytest.mark.parametrize("arch", ["gemma3_text", "lfm2", "falcon_h1"])
def test_other_model_types_keep_their_final_norm_rows_and_speculate(arch, tmp_path):
    """The final norm of Gemma 3 (sliding layers, scaled embeddings), LFM2 (``embedding_norm``; recurrent
    short convolutions beside attention) and Falcon-H1 (``final_layernorm``; Mamba-2 state + KV): the rows
    equal one plain forward's after chunks and, on the recurrent ones, a rollback replayed from the
    checkpoint; greedy speculation with Medusa heads equals plain decoding."""
    from edgespec.drafters.medusa import MedusaRunner
    from edgespec.engine import Engine

    d = build_tiny_mlx(tmp_path / arch, model_type=arch, n_vocab=N_VOCAB)
    rng = np.random.default_rng(5)
    seq = [int(x) for x in rng.integers(0, N_VOCAB, 9)]
    t = MlxHiddenBackend(d, vocab=ReferenceBackend(N_VOCAB), n_batch=3)
    t.eval(seq[:4], rows="none")
    t.checkpoint()
    t.eval(seq[4:], rows="all")
    t.truncate(6)  # a recurrent target re-evaluates positions 4, 5 from its checkpoint
    t.eval([3, 1], rows="last")
    kept = seq[:6] + [3, 1]
    with MlxBackend(d, vocab=ReferenceBackend(N_VOCAB)) as plain:
        want = plain.model.model(mx.array([kept]))[0].astype(mx.float32)
        mx.eval(want)
    got = np.stack([t.hidden(p) for p in range(len(kept))])
    assert t.hidden(len(kept)) is None and _rel_diff(got, np.array(want)) <= TOL, arch
    config, tensors = _random_heads(t.n_embd, seed=7)
    drafter = MedusaDrafter(MedusaRunner(config, tensors, t.output_matrix()), t)
    t.truncate(0)
    with Engine(t, drafter, num_draft=3) as engine:
        accepted = 0
        for prompt in ([1, 2, 3, 4, 5], [7, 7, 0, 11, 2, 9]):
            plain_out = engine.generate(prompt, max_tokens=24, speculative=False)
            spec = engine.generate(prompt, max_tokens=24)
            assert spec.tokens == plain_out.tokens, (arch, prompt)
            assert spec.stats.n_drafted > 0
            accepted += spec.stats.n_accepted
    print(f"{arch}: {accepted} draft tokens accepted")


def test_a_model_without_a_known_final_norm_is_refused(tmp_path):
    from edgespec.errors import ModelLoadError

    d = build_tiny_mlx(tmp_path / "mamba2", model_type="mamba2", n_vocab=N_VOCAB)
    with pytest.raises(ModelLoadError, match="Medusa heads") as e:
        MlxHiddenBackend(d, vocab=ReferenceBackend(N_VOCAB))
    assert "\n" not in str(e.value) and "mamba2" in str(e.value)


def test_greedy_auto_trees_on_mlx(files):  # noqa: F811
    """`--tree auto` with Medusa heads on MLX, schedule.trees on a flat T(k) so that trees are taken while
    the scheduler still drafts: greedy == plain, token for token (as test_medusa_drafter's on llama.cpp)."""
    from dataclasses import replace

    from test_tree_auto import FLAT, _scheduler

    from edgespec.schedule.trees import TreeScheduling

    with edgespec.load(files["target"], drafter=str(files["shared"]), backend="mlx", n_ctx=512,
                       num_draft="auto", tree="auto") as engine:
        prior = replace(engine.drafter.cost_prior(), fixed_ms=0.1, per_token_ms=0.1)
        sched, trees = TreeScheduling(_scheduler(FLAT, prior), 16), 0
        for p in (PROMPT, "Once upon a time"):
            want = engine.generate(p, max_tokens=24, speculative=False)
            spec = engine.generate(p, max_tokens=24, scheduler=sched)
            assert spec.tokens == want.tokens, p
            trees += spec.stats.tree_cycles
        assert trees > 0
