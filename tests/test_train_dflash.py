"""DFlash and DSpark head training: the torch DFlash head equals the numpy reference (single block and
the batched training blocks), training on the tiny target lowers the loss and raises held-out
acceptance, DSpark's Markov head improves on its frozen DFlash base, and checkpoints resume exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from head_oracles import DFlashHead

torch = pytest.importorskip("torch")

from train_fixtures import LAYERS, build_caches, resume_equals_uninterrupted  # noqa: E402

from edgespec.heads.dflash import DFlashConfig, random_tensors  # noqa: E402
from edgespec.train.dflash_model import DFLASH_DECAY, TorchDFlash  # noqa: E402
from edgespec.train.dspark_model import TorchDSpark, dspark_config, init_dspark  # noqa: E402
from edgespec.train.features import FeatureCache  # noqa: E402
from edgespec.train.pipeline import HeadJob, build_head  # noqa: E402
from edgespec.train.trainer import TrainConfig, Trainer  # noqa: E402

V, VD, H = 100, 40, 64


@pytest.fixture(scope="module")
def caches(tmp_path_factory, tiny_target):
    return build_caches(tmp_path_factory, tiny_target)


def _random_head(**kw) -> tuple[DFlashConfig, dict, np.ndarray]:
    cfg = DFlashConfig(**(dict(n_embd=H, n_layer=2, n_head=4, n_head_kv=2, n_ff=96, target_layers=(2, 5, 7),
                                n_vocab=V, n_draft_vocab=VD, mask_token_id=99, block_size=8, rope_base=10000.0) | kw))
    rng = np.random.default_rng(0)
    tensors = random_tensors(cfg, seed=1, d2t=np.sort(rng.choice(V, VD, replace=False)))
    return cfg, tensors, rng.standard_normal((V, H)).astype(np.float32)


@pytest.mark.parametrize("kw", [{}, dict(causal=True, embedding_scale=1.5, attention_scale=0.2, value_scale=0.7,
                                        n_rot=8, n_head_kv=4)])
def test_torch_block_equals_numpy(kw):
    cfg, tensors, emb = _random_head(**kw)
    head = DFlashHead(cfg, tensors, tok_embd=emb)
    feats = np.random.default_rng(2).standard_normal((11, cfg.n_embd_enc)).astype(np.float32)
    head.inject(feats)
    ref, ref_h = head.forward_block(head.block_tokens(5))
    with torch.no_grad():
        logits, h = TorchDFlash(cfg, tensors, emb).forward_block(torch.tensor(feats),
                                                                 torch.tensor(head.block_tokens(5)))
    assert (np.isfinite(logits.numpy()) == np.isfinite(ref)).all()
    fin = np.isfinite(ref)
    np.testing.assert_allclose(logits.numpy()[fin], ref[fin], atol=1e-4)
    np.testing.assert_allclose(h.numpy(), ref_h, atol=1e-4)


def test_feature_scale_is_folded_into_the_exported_fc():
    """Training on features ⊙ scale and exporting fc ⊙ scale is the same function: the numpy head on
    the exported tensors and raw features == the torch head on raw features."""
    cfg, tensors, emb = _random_head()
    rng = np.random.default_rng(4)
    scale = np.exp(rng.normal(0, 2, cfg.n_embd_enc)).astype(np.float32)  # spans ~e^±6
    model = TorchDFlash(cfg, tensors, emb)
    model.set_feature_scale(scale)
    feats = (rng.standard_normal((9, cfg.n_embd_enc)) / scale).astype(np.float32)
    exported = model.to_numpy()
    np.testing.assert_allclose(exported["fc.weight"], tensors["fc.weight"] * scale[None, :], rtol=1e-6)
    head = DFlashHead(cfg, exported, tok_embd=emb)
    head.inject(feats)
    ref = head.block_logits(head.block_tokens(7))
    with torch.no_grad():
        logits, _ = model.forward_block(torch.tensor(feats), torch.tensor(head.block_tokens(7)))
    fin = np.isfinite(ref)
    np.testing.assert_allclose(logits.numpy()[fin], ref[fin], atol=1e-4)


def test_feature_rms_per_dimension(caches):
    from edgespec.train.pipeline import feature_rms

    train = caches[0]
    x = np.concatenate([FeatureCache.load_file(f)["feats"] for f in train.files()[:3]]).astype(np.float64)
    want = np.sqrt((x * x).mean(0))
    np.testing.assert_allclose(feature_rms(train.files(), n_files=3), np.maximum(want, 1e-3 * np.median(want)),
                               rtol=1e-5)


def test_linear_learning_rate_decay(caches):
    trainer = _dflash(caches, batch=1, lr=1e-3, decay_steps=4)
    seen = []
    for _ in range(4):
        trainer.train_step()
        seen.append(trainer.opt.param_groups[0]["lr"])
    np.testing.assert_allclose(seen, [1e-3, 0.75e-3, 0.5e-3, 0.25e-3])


def test_training_blocks_are_drafting_blocks():
    """Block m of the batched training forward (anchor a, context p < a) == the numpy head drafting
    after a context of a positions with t_a pending."""
    cfg, tensors, emb = _random_head()
    rng = np.random.default_rng(3)
    seq = {"tokens": torch.tensor(rng.integers(0, V - 1, 30)),
           "feats": torch.tensor(rng.standard_normal((30, cfg.n_embd_enc)).astype(np.float32))}
    with torch.no_grad():
        a, block, z, _ = TorchDFlash(cfg, tensors, emb).anchor_blocks(seq, np.random.default_rng(0), 5)
    assert len(a) == 5 and (a >= 1).all() and (a <= 30 - 8).all()
    for m, anchor in enumerate(a.tolist()):
        head = DFlashHead(cfg, tensors, tok_embd=emb)
        head.inject(seq["feats"][:anchor].numpy())
        assert block[m].tolist() == head.block_tokens(int(seq["tokens"][anchor]))
        ref = head.block_logits(block[m].tolist())[:, tensors["d2t"]]
        np.testing.assert_allclose(z[m].numpy(), ref, atol=1e-4)


def _dflash(caches, **kw) -> Trainer:
    train, held, info, d2t = caches
    model = build_head(HeadJob(target=Path("t.gguf"), out=Path("h.gguf"), kind="dflash"), info, LAYERS, d2t)
    cfg = TrainConfig(**({"batch": 4, "lr": 3e-3, "step_decay": DFLASH_DECAY, "anchors": 16} | kw))
    return Trainer(model, train.files(), held.files(), cfg)


@pytest.fixture(scope="module")
def trained_dflash(caches):
    tr = _dflash(caches)
    before = tr.evaluate()
    losses = [tr.train_step() for _ in range(300)]
    return tr, before, losses


def test_dflash_loss_falls_and_acceptance_rises(trained_dflash):
    tr, before, losses = trained_dflash
    after = tr.evaluate()
    assert len(after["acceptance"]) == 7
    assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:10])  # measured: 10.7 → 4.1
    assert after["loss"] < before["loss"] - 0.5  # measured: 14.7 → 4.7
    assert after["acceptance"][0] > before["acceptance"][0] + 0.05  # measured: 0 → 0.10
    assert all(x >= y for x, y in zip(after["acceptance"], after["acceptance"][1:]))  # chained


def test_dflash_checkpoint_resume_equals_uninterrupted(caches, tmp_path):
    resume_equals_uninterrupted(lambda: _dflash(caches), tmp_path)


@pytest.fixture(scope="module")
def trained_dspark(caches, trained_dflash):
    """(DSpark trainer after 300 steps on the trained DFlash head, its held-out evaluation before, the
    base's state before)."""
    train, held, _, _ = caches
    base = trained_dflash[0].model
    frozen = TorchDFlash(base.config, base.to_numpy(), base.tok_embd.numpy())
    model = TorchDSpark(frozen, init_dspark(dspark_config(base.config, 16), seed=0), 16)
    tr = Trainer(model, train.files(), held.files(), TrainConfig(batch=4, lr=1e-2, step_decay=DFLASH_DECAY, anchors=16))
    seq = tr._tensors(held.files()[0])
    with torch.no_grad():
        _, right_base = trained_dflash[0].sequence_loss(seq)
        _, right = tr.sequence_loss(seq)
    assert torch.equal(right, right_base)  # markov_w2 = 0: the head starts as its DFlash base
    state = {k: v.clone() for k, v in tr.model.base.state_dict().items()}
    start = tr.evaluate()
    for _ in range(300):
        tr.train_step()
    return tr, start, state


def test_dspark_improves_on_its_frozen_base(trained_dspark, trained_dflash):
    tr, start, state = trained_dspark
    # every position of the held-out sequences: on the tiny random target's own generations neither
    # head gets past row 1 (both 0.06 0 0 …), so only its prompt text can show the Markov head's effect
    end, base_end = tr.evaluate(generated_only=False), trained_dflash[0].evaluate(generated_only=False)
    assert all(torch.equal(v, tr.model.base.state_dict()[k]) for k, v in state.items())  # the base is frozen
    assert end["loss"] < start["loss"] - 0.5  # measured: 5.4 → 3.4 (CE + BCE)
    assert end["acceptance"][0] > base_end["acceptance"][0] + 0.04  # measured: 0.10 → 0.17
    assert sum(end["acceptance"]) > sum(base_end["acceptance"])


def test_dspark_confidence_ranks_right_rows_higher(trained_dspark, caches):
    tr = trained_dspark[0]
    conf_right, conf_wrong = [], []
    with torch.no_grad():
        for f in caches[1].files():
            seq = tr._tensors(f)
            a, _, z, h = tr.model.base.anchor_blocks(seq, None, 0)
            rows = a[:, None] + torch.arange(7)
            logits, conf = tr.model.markov(z[:, 1:], h[:, 1:], seq["tokens"][rows])
            right = tr.model.d2t[logits.argmax(-1)] == seq["top_ids"][rows, 0]
            conf_right += torch.sigmoid(conf[right]).tolist()
            conf_wrong += torch.sigmoid(conf[~right]).tolist()
    assert conf_right and conf_wrong
    assert np.mean(conf_right) > np.mean(conf_wrong) + 0.1


def test_mask_token_of_the_tiny_target_is_its_unknown_token(caches):
    assert caches[2]["mask_token_id"] == 0  # SmolLM2's tokenizer: <|endoftext|>, the unknown token
    z = FeatureCache.load_file(caches[0].files()[0])
    assert 0 not in z["tokens"][1:].tolist()


def test_exported_dspark_head_reads_back_as_the_numpy_dspark(trained_dspark, caches, tmp_path, tiny_target):
    """The exported GGUF (F32), read by the numpy DFlash + DSpark heads, gives the torch model's Markov
    logits and confidences for every row of a block (prev teacher-forced, as in training)."""
    from edgespec.heads.dflash_gguf import read_dflash_gguf
    from edgespec.heads.dspark import MarkovHead

    tr = trained_dspark[0]
    path = tr.export(tmp_path / "dspark.gguf", Path(tiny_target), "f32")
    cfg, tensors = read_dflash_gguf(path)
    assert cfg == tr.model.config and cfg.markov_rank == 16 and cfg.has_confidence
    head = DFlashHead(cfg, tensors, tok_embd=caches[2]["tok_embd"])
    markov = MarkovHead(cfg, tensors)
    seq = tr._tensors(caches[1].files()[0])
    anchor = 20
    head.inject(seq["feats"][:anchor].numpy())
    z, h = head.forward_block(head.block_tokens(int(seq["tokens"][anchor])))
    with torch.no_grad():
        a, _, tz, th = tr.model.base.anchor_blocks(seq, None, 0)
        m = int((a == anchor).nonzero()[0, 0])
        prev = seq["tokens"][anchor:anchor + 7]
        logits, conf = tr.model.markov(tz[m, 1:], th[m, 1:], prev)
    for r in range(1, 8):
        ref = markov.apply(z[r], int(prev[r - 1]))[tensors["d2t"]]
        np.testing.assert_allclose(logits[r - 1].numpy(), ref, atol=1e-3)
        ref_conf = markov.confidence(h[r], int(prev[r - 1]))
        assert abs(float(torch.sigmoid(conf[r - 1])) - ref_conf) < 1e-4
