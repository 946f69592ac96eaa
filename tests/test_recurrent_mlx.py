"""Recurrent and hybrid targets on the MLX backend.

On tiny mlx-lm models built from their ModelArgs (Mamba, Mamba-2, LFM2, Falcon-H1; a letters
vocabulary): checkpoint + truncate gives the logits of a fresh evaluation, the errors, and greedy
speculative == plain with an n-gram and a draft-model drafter. On the mamba2 / lfm2 fixture GGUFs
(marked real: they carry SmolLM2's tokenizer), converted to MLX: logits match llama.cpp's on the same
file, and greedy speculative == plain through ``edgespec.load(..., backend="mlx")``.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from mlx_fixtures import build_tiny_mlx, own_mlx_home  # noqa: F401 (own_mlx_home: used by usefixtures)
from recurrent_fixtures import build_tiny_mamba2, recurrent_ggufs  # noqa: F401 (recurrent_ggufs: a fixture)

pytest.importorskip("mlx.core", reason="mlx is not installed: pip install 'edgespec[mlx]'")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed: pip install 'edgespec[mlx]'")

import edgespec  # noqa: E402
from edgespec.backends.mlx import MlxBackend  # noqa: E402
from edgespec.backends.reference import ReferenceBackend  # noqa: E402
from edgespec.drafters.draft_model import DraftModelDrafter  # noqa: E402
from edgespec.drafters.ngram import NgramDrafter  # noqa: E402
from edgespec.drafters.registry import open_backend  # noqa: E402
from edgespec.engine import Engine  # noqa: E402
from edgespec.errors import BackendError, ModelLoadError  # noqa: E402
from edgespec.gguf_file import add_fields, read_gguf  # noqa: E402

N_VOCAB = 12
ARCHS = ("mamba", "mamba2", "lfm2", "falcon_h1")  # recurrent; hybrids (LFM2: separate KV layers,
# Falcon-H1: state + KV in one CacheList per layer)
# Measured max|Δ| against a fresh evaluation: 0 for mamba and lfm2, 1.4e-6 for mamba2 (mlx-lm's chunked
# SSD scan sums in another order over a different split of the tokens), 1e-8 for falcon_h1.
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, tuple]:
    """arch → (target directory, drafter directory: the target's weights + 0.05 × noise)."""
    root = tmp_path_factory.mktemp("recurrent-mlx")
    return {a: (build_tiny_mlx(root / a, model_type=a, n_vocab=N_VOCAB),
                build_tiny_mlx(root / f"{a}-draft", model_type=a, n_vocab=N_VOCAB, seed=1, base_seed=0, perturb=0.05))
            for a in ARCHS}


def _open(path) -> MlxBackend:
    return MlxBackend(path, vocab=ReferenceBackend(N_VOCAB))


@pytest.mark.parametrize("arch", ARCHS)
def test_truncate_after_one_checkpoint_matches_a_fresh_evaluation(arch, tiny_dirs):
    """Several truncates (to the checkpoint itself, inside, after re-extending) after one checkpoint:
    every logit row afterwards is that of a fresh model fed the same tokens in one evaluation."""
    path = tiny_dirs[arch][0]
    b = _open(path)
    assert b.recurrent
    rng = np.random.default_rng(3)
    seq = [int(t) for t in rng.integers(0, N_VOCAB, 9)]
    b.eval(seq, rows="none")
    b.checkpoint()
    at = len(seq)
    for cut in (at + 4, at + 1, at, at + 6, at + 2):
        new = [int(t) for t in rng.integers(0, N_VOCAB, 7)]
        got = b.eval(new, rows="all")  # (7, V)
        seq += new
        want = _open(path).eval(seq, rows="all")  # (T, V)
        np.testing.assert_allclose(got, want[-len(new):], rtol=RTOL, atol=ATOL)
        b.truncate(cut)
        seq = seq[:cut]
        assert b.n_past == cut and all(c.offset == cut for c in b._kv)
        nxt = int(rng.integers(0, N_VOCAB))
        got = b.eval([nxt], rows="last")  # (1, V)
        seq.append(nxt)
        np.testing.assert_allclose(got[0], _open(path).eval(seq, rows="last")[0], rtol=RTOL, atol=ATOL)


def test_truncate_needs_a_checkpoint_at_or_before_the_position(tiny_dirs):
    b = _open(tiny_dirs["lfm2"][0])
    b.eval([1, 2, 3, 4, 5], rows="none")
    with pytest.raises(BackendError, match="from 5 to 3 tokens.*none was taken"):
        b.truncate(3)
    b.checkpoint()
    b.eval([6, 7], rows="none")
    with pytest.raises(BackendError, match="from 7 to 4 tokens.*the last one is at 5"):
        b.truncate(4)
    assert b.n_past == 7
    b.truncate(0)  # always possible: fresh caches, and the checkpoint is gone
    assert b.n_past == 0 and all(c.offset == 0 for c in b._kv)
    np.testing.assert_allclose(b.eval([1, 2, 3], rows="all"), _open(tiny_dirs["lfm2"][0]).eval([1, 2, 3], rows="all"),
                               rtol=RTOL, atol=ATOL)
    with pytest.raises(BackendError, match="none was taken"):
        b.truncate(1)


def test_attention_only_models_stay_non_recurrent(tmp_path):
    b = _open(build_tiny_mlx(tmp_path / "llama", n_vocab=N_VOCAB))
    b.eval([1, 2, 3, 4], rows="none")
    b.checkpoint()  # a no-op: the KV cache trims to any position
    b.truncate(1)
    assert not b.recurrent and b.n_past == 1


def _spec_equals_plain(engine: Engine, prompt, what: tuple) -> tuple[int, int]:
    """Greedy spec == plain over 64 tokens at γ = 4 and auto; returns the (full, partial) verification
    cycles seen: all drafts accepted / some rejected."""
    plain = engine.generate(prompt, max_tokens=64, speculative=False)
    full = partial = 0
    for gamma in (4, "auto"):
        spec = engine.generate(prompt, max_tokens=64, num_draft=gamma)
        assert spec.tokens == plain.tokens, (*what, gamma, prompt)
        cycles = [(d, n) for d, n in spec.stats.cycles if d > 0]
        full, partial = full + sum(n == d for d, n in cycles), partial + sum(n < d for d, n in cycles)
    return full, partial


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_spec_equals_plain_on_tiny_recurrent_models(arch, tiny_dirs):
    target_dir, draft_dir = tiny_dirs[arch]
    target = _open(target_dir)
    drafters = {"ngram": NgramDrafter(), "draft model": DraftModelDrafter(_open(draft_dir), N_VOCAB)}
    rng = np.random.default_rng(11)
    prompts = [[int(t) for t in rng.integers(0, N_VOCAB, 6)] * 2 for _ in range(5)]  # repeats: n-gram matches
    full = partial = 0  # over both drafters (the n-gram one may never be fully right on random weights)
    for name, drafter in drafters.items():
        engine = Engine(target, drafter)
        for prompt in prompts:
            f, p = _spec_equals_plain(engine, prompt, (arch, name))
            full, partial = full + f, partial + p
    assert full > 0 and partial > 0, (arch, full, partial)


# -- the fixture GGUFs, converted ---------------------------------------------------------------------

TEXT = ["The history of the printing press begins", "def fibonacci(n):\n", "1, 2, 3, 4, 5,",
        "Once upon a time, in a village", "Q: What is the boiling point of water?\nA:"]


def _tied_copy(src, dst):
    """``src`` without output.weight (llama.cpp then reads the token embeddings as the head): mlx-lm's
    lfm2 always ties them, as the released LFM2 models do."""
    f = read_gguf(src)
    w = gguf.GGUFWriter(dst, f.value("general.architecture"))
    add_fields(w, {k: v for k, v in f.kv.items() if k != "general.architecture"})
    for name in f.tensors:
        if name != "output.weight":
            w.add_tensor(name, f.tensor(name))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def converted_pairs(recurrent_ggufs, tmp_path_factory):  # noqa: F811 (the imported fixture)
    """arch → (target, drafter) GGUFs that mlx-lm's classes can hold (lfm2: tied copies)."""
    root = tmp_path_factory.mktemp("tied")
    return {arch: tuple(_tied_copy(p, root / p.name) for p in pair) if arch == "lfm2" else pair
            for arch, pair in recurrent_ggufs.items()}


@pytest.mark.real
@pytest.mark.usefixtures("own_mlx_home")
def test_an_untied_lfm2_head_is_refused(recurrent_ggufs):  # noqa: F811
    with pytest.raises(ModelLoadError, match="lfm2 ties the output head"):
        open_backend(recurrent_ggufs["lfm2"][0], "mlx")


@pytest.mark.real
@pytest.mark.usefixtures("own_mlx_home")
@pytest.mark.parametrize("arch", ["mamba2", "lfm2"])
def test_converted_fixture_matches_llama_cpp(arch, converted_pairs):
    """f32 weights and an f32 KV cache: only the summation order differs. Measured max|Δ| / logit
    range: 7e-7 (mamba2), 2e-4 (lfm2); with llama.cpp's default Q8_0 KV cache lfm2 reaches 4e-3."""
    path = converted_pairs[arch][0]
    lc = open_backend(path, n_ctx=256, kv_type="f32")
    ml = open_backend(path, "mlx", n_ctx=256)
    assert ml.recurrent and lc.recurrent
    ids = lc.tokenize(" ".join(TEXT))
    assert ml.tokenize(" ".join(TEXT)) == ids and ml.n_vocab == lc.n_vocab
    a, b = lc.eval(ids, "all"), ml.eval(ids, "all")  # (T, V)
    diff = np.abs(a - b).max(1)
    assert (diff <= 1e-3 * (a.max(1) - a.min(1))).all()
    top2 = np.sort(a, axis=1)[:, -2:]
    flips = a.argmax(1) != b.argmax(1)  # allowed only at near-ties, closer than the row's difference
    assert (top2[flips, 1] - top2[flips, 0] <= 2 * diff[flips]).all() and flips.mean() <= 0.05


@pytest.mark.real
@pytest.mark.usefixtures("own_mlx_home")
@pytest.mark.parametrize("arch", ["mamba2", "lfm2"])
def test_greedy_spec_equals_plain_on_converted_fixtures(arch, converted_pairs):
    target, draft = converted_pairs[arch]
    full = partial = 0  # over both drafters (the n-gram one is rarely right on random weights)
    for drafter in ("ngram", str(draft)):
        with edgespec.load(target, drafter=drafter, backend="mlx", n_ctx=512) as engine:
            assert engine.target.recurrent
            for text in TEXT:
                # its tail occurs earlier: the n-gram drafter has matches to draft
                f, p = _spec_equals_plain(engine, f"{text} {text}", (arch, drafter))
                full, partial = full + f, partial + p
    assert full > 0 and partial > 0, (full, partial)


@pytest.mark.real
@pytest.mark.usefixtures("own_mlx_home")
def test_grouped_mamba2_norm_is_refused(smollm2_path, tmp_path):
    path = build_tiny_mamba2(tmp_path / "grouped.gguf", vocab_source=smollm2_path, n_group=2)
    with pytest.raises(ModelLoadError, match="ssm.group_count 2"):
        open_backend(path, "mlx")


def test_feature_heads_refuse_a_recurrent_mlx_target(tiny_dirs):
    from edgespec.backends.mlx_features import MlxFeatureBackend
    from edgespec.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="feature heads need an attention-only target; model type 'mamba'"):
        MlxFeatureBackend(tiny_dirs["mamba"][0], vocab=ReferenceBackend(N_VOCAB))
