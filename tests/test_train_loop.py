"""Head training on the tiny target: loss falls, checkpoints resume exactly, and the exported GGUF,
read back, drafts like the torch model it came from."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from train_fixtures import LAYERS, SEQ, build_caches, resume_equals_uninterrupted  # noqa: E402

from edgespec.backends.llama_features import LlamaFeatureBackend  # noqa: E402
from edgespec.heads.eagle3 import Eagle3Head  # noqa: E402
from edgespec.heads.gguf_io import read_eagle3_gguf  # noqa: E402
from edgespec.train import prompts as P  # noqa: E402
from edgespec.train.data import local_corpus  # noqa: E402
from edgespec.train.features import CachePlan, FeatureCache, build_cache  # noqa: E402
from edgespec.train.model import TorchEagle3  # noqa: E402
from edgespec.train.trainer import TrainConfig, Trainer, head_config, init_tensors  # noqa: E402


@pytest.fixture(scope="module")
def caches(tmp_path_factory, tiny_target):
    return build_caches(tmp_path_factory, tiny_target)


def _trainer(caches, **kw) -> Trainer:
    train, held, info, d2t = caches
    cfg = head_config(info["n_embd"], info["n_head"], info["n_head_kv"], info["n_ff"], LAYERS,
                      len(info["tok_embd"]), len(d2t))
    model = TorchEagle3(cfg, init_tensors(cfg, d2t, seed=0), info["tok_embd"])
    return Trainer(model, train.files(), held.files(), TrainConfig(**({"batch": 2, "lr": 3e-3, "ttt_steps": 3} | kw)))


def test_features_beyond_float16_range_survive_the_cache():
    from edgespec.train.features import pack_features

    f = np.random.default_rng(0).standard_normal((4, 12)).astype(np.float32)
    f[1, 3], f[2, 0] = 2.5e5, -7e4  # outlier dimensions of a residual stream (Gemma-3 has them)
    half, scale = pack_features(f)
    back = half.astype(np.float32) * scale[:, None]
    assert np.isfinite(half).all() and scale[0] == 1.0 and scale[3] == 1.0
    assert (np.abs(back - f) <= 1e-3 * np.abs(f).max(1, keepdims=True)).all()


def test_cache_contents_and_resume(caches, tiny_target):
    train, held, _, _ = caches
    files = train.files()
    assert len(files) > 20 and len(held.files()) == 3
    z = FeatureCache.load_file(files[0])  # the first sequence: a greedy generation on a training prompt
    n = len(z["tokens"])
    assert z["feats"].shape == (n, 3 * 64) and z["feats"].dtype == np.float32
    assert z["top_ids"].shape == (n, 32) and z["top_lp"].dtype == np.float16
    assert (np.diff(z["top_lp"].astype(np.float32), axis=1) <= 1e-3).all()  # descending
    gen = z["tokens"][-10:]  # generated tokens are the target's own argmax
    np.testing.assert_array_equal(z["top_ids"][-11:-1, 0], gen)
    mtimes = [f.stat().st_mtime_ns for f in files]
    with LlamaFeatureBackend(tiny_target, layers=LAYERS, n_ctx=256, threads=1) as be:
        plan = CachePlan(target=str(tiny_target), target_size=1, seq_len=SEQ, corpus_chars=24_000, n_prompts=2,
                         gen_tokens=24)
        build_cache(be, train.root, plan, list(local_corpus(max_chars=24_000, seed=0)), P.TRAIN_PROMPTS[:2])
        assert [f.stat().st_mtime_ns for f in train.files()] == mtimes  # nothing recomputed
        with pytest.raises(ValueError, match="another plan"):
            build_cache(be, train.root, CachePlan(target="x", target_size=1), [], [])


def test_loss_falls_and_acceptance_rises(caches):
    tr = _trainer(caches)
    before = tr.evaluate()
    losses = [tr.train_step() for _ in range(200)]
    after = tr.evaluate()
    assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:10])  # measured: 6.2 → 3.0
    assert after["loss"] < before["loss"] - 0.5
    assert after["acceptance"][0] > before["acceptance"][0] + 0.03  # measured: 0 → 0.08
    assert len(after["acceptance"]) == 3 and after["acceptance"][2] <= after["acceptance"][0]


def test_checkpoint_resume_equals_uninterrupted(caches, tmp_path):
    a, c = resume_equals_uninterrupted(lambda: _trainer(caches), tmp_path)
    for sa, sc in zip(a.opt.state_dict()["state"].values(), c.opt.state_dict()["state"].values()):
        assert torch.equal(sa["exp_avg"], sc["exp_avg"])


@pytest.mark.parametrize("weight_type, min_agree", [("f32", 1.0), ("f16", 0.97), ("q8_0", 0.9)])
def test_exported_gguf_drafts_like_the_torch_head(caches, tmp_path, tiny_target, weight_type, min_agree):
    tr = _trainer(caches)
    for _ in range(5):
        tr.train_step()
    path = tr.export(tmp_path / "head.gguf", Path(tiny_target), weight_type)
    cfg, tensors = read_eagle3_gguf(path)
    assert cfg == tr.model.config
    np.testing.assert_array_equal(tensors["d2t"], tr.model.d2t.numpy())
    z = FeatureCache.load_file(caches[1].files()[0])
    feats, tokens = z["feats"].astype(np.float32)[:-1], z["tokens"][1:].astype(np.int64)
    head = Eagle3Head(cfg, tensors, tok_embd=caches[2]["tok_embd"])
    ref_logits, _ = head.decode(tokens.tolist(), head.encode(feats))
    with torch.no_grad():
        logits, _ = tr.model.decode_plain(torch.tensor(tokens), tr.model.encode(torch.tensor(feats)))
    agree = (ref_logits.argmax(1) == logits.numpy().argmax(1)).mean()
    assert agree >= min_agree


def test_numpy_chain_acceptance_matches_the_trainers_on_generated_text(caches, tmp_path, tiny_target):
    """evaluate.chain_acceptance (numpy head drafting from its own tokens) == Trainer.evaluate's
    teacher-forced acceptance on sequences the target generated itself, where the two coincide."""
    from edgespec.train.evaluate import chain_acceptance, generated_start

    tr = _trainer(caches)
    for _ in range(30):
        tr.train_step()
    path = tr.export(tmp_path / "head.gguf", Path(tiny_target), "f32")
    cfg, tensors = read_eagle3_gguf(path)
    head = Eagle3Head(cfg, tensors, tok_embd=caches[2]["tok_embd"])
    files = caches[1].files()
    got = chain_acceptance(head, files, depth=3)
    # the trainer's count restricted to the same origins
    hits, total = np.zeros(3), 0
    for f in files:
        z = FeatureCache.load_file(f)
        start = max(generated_start(z["tokens"], z["top_ids"][:, 0]), 1)
        _, right = tr.sequence_loss(tr._tensors(f), 3)
        r = np.stack([x.numpy() for x in right])
        n = r.shape[1]
        for o in range(start - 1, n - 3 + 1):
            chain = np.cumprod([r[j, o + j] for j in range(3)])
            hits += chain
            total += 1
    assert got["origins"] == total > 20
    np.testing.assert_allclose(got["acceptance"], hits / total, atol=1e-9)


def test_cache_records_prompt_length_and_backfills_it(caches, tiny_target, tmp_path):
    """Generations record how many leading tokens are the prompt (what held-out acceptance skips), corpus
    windows 0; a cache written before n_prompt existed gets it added on the next build, by tokenizing."""
    import shutil

    from edgespec.train.evaluate import generated_start

    train, held, _, _ = caches
    for f in held.files():  # every held-out sequence is a generation: the prompt ends where greedy text starts
        z = FeatureCache.load_file(f)
        assert 0 < z["n_prompt"] == generated_start(z["tokens"], z["top_ids"][:, 0]) + 1
    assert int(FeatureCache.load_file(train.files()[-1])["n_prompt"]) == 0  # a corpus window
    old = tmp_path / "old"
    shutil.copytree(held.root, old)
    want = [int(FeatureCache.load_file(f)["n_prompt"]) for f in held.files()]
    for f in FeatureCache(old).files():
        with np.load(f) as z:
            arrays = {k: z[k] for k in z.files if k != "n_prompt"}
        np.savez(f, **arrays)
    assert [int(FeatureCache.load_file(f)["n_prompt"]) for f in FeatureCache(old).files()] == [0, 0, 0]
    with LlamaFeatureBackend(tiny_target, layers=LAYERS, n_ctx=256, threads=1) as be:
        plan = CachePlan(target=str(tiny_target), target_size=1, seq_len=SEQ, corpus_chars=24_000, n_prompts=2,
                         gen_tokens=24)
        build_cache(be, old, plan, [], P.HELDOUT_PROMPTS[:3])
    assert [int(FeatureCache.load_file(f)["n_prompt"]) for f in FeatureCache(old).files()] == want


def test_acceptance_skips_chains_that_start_in_the_prompt():
    """Chain c's first draft predicts t_{c+2}: with skip s, chains 0..s−1 are not counted (hand counts)."""
    from edgespec.train.model import chain_counts

    right = torch.tensor([[1, 1], [1, 0], [0, 1], [1, 1]], dtype=torch.bool)  # blocks × rows
    hits, counts = chain_counts(right, skip=2)
    assert hits.tolist() == [1, 1] and counts.tolist() == [2, 2]
    steps = [torch.tensor([1, 1, 0, 1, 1], dtype=torch.bool), torch.tensor([1, 0, 1, 1, 0], dtype=torch.bool)]
    # origin o ≥ 2: step 1 row o, step 2 row o+1. k=1: rows 2, 3, 4 = 0, 1, 1 → 2 of 3;
    # k=2: o=2 fails at step 1, o=3 at step 2 (row 4 = 0) → 0 of 2
    hits, counts = TorchEagle3.acceptance_counts(steps, skip=2)
    assert hits.tolist() == [2, 0] and counts.tolist() == [3, 2]
