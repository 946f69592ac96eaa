"""The torch EAGLE-3 head (edgespec.train.model) computes the numpy reference's function, and its
training-time-test rollout equals the numpy head drafting a chain from its own hidden states."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from edgespec.heads.eagle3 import Eagle3Config, Eagle3Head, random_tensors  # noqa: E402
from edgespec.train.model import TorchEagle3  # noqa: E402

V, VD, H, HT, N = 120, 50, 32, 24, 12


def _setup(**kw):
    cfg = Eagle3Config(**(dict(n_embd=H, n_head=4, n_head_kv=2, n_ff=40, n_embd_tgt=HT, target_layers=(1, 2, 3),
                               n_vocab=V, n_draft_vocab=VD) | kw))
    rng = np.random.default_rng(5)
    d2t = np.sort(rng.choice(V, VD, replace=False))
    t = random_tensors(cfg, seed=3, d2t=d2t)
    for name in t:
        if name.endswith("norm.weight") or name.endswith("norm_2.weight"):
            t[name] = (1 + 0.3 * rng.standard_normal(t[name].shape)).astype(np.float32)
    emb = rng.standard_normal((V, H), dtype=np.float32)
    tokens = rng.integers(0, V, N + 1)
    feats = rng.standard_normal((N, 3 * HT), dtype=np.float32)
    return cfg, t, emb, tokens, feats


@pytest.mark.parametrize("kw", [{}, {"norm_before_residual": True}, {"norm_before_fc": True, "n_rot": 4}])
def test_torch_forward_equals_numpy(kw):
    cfg, t, emb, tokens, feats = _setup(**kw)
    if cfg.norm_before_fc:
        t["enc.output_norm.weight"] = np.linspace(0.5, 1.5, 3 * HT, dtype=np.float32)
    ref = Eagle3Head(cfg, t, tok_embd=emb)
    g = ref.encode(feats)
    want_logits, want_h = ref.decode(tokens[1:].tolist(), g)
    model = TorchEagle3(cfg, t, emb)
    with torch.no_grad():
        tg = model.encode(torch.tensor(feats))
        logits, h = model.decode_plain(torch.tensor(tokens[1:]), tg)
    np.testing.assert_allclose(tg.numpy(), g, atol=1e-4)
    np.testing.assert_allclose(h.numpy(), want_h, atol=1e-4)
    fin = np.isfinite(want_logits)
    assert (np.isfinite(logits.numpy()) == fin).all()
    np.testing.assert_allclose(logits.numpy()[fin], want_logits[fin], atol=1e-4)
    assert {k: v.shape for k, v in model.to_numpy().items()} == {k: v.shape for k, v in t.items()}


def test_rollout_equals_numpy_chain_drafting():
    """TTT step k at row P == the numpy head drafting its k-th token from origin o = P-k+1: cache of
    real features for positions ≤ o, then its own pre-norm h as the next g."""
    cfg, t, emb, tokens, feats = _setup()
    steps = 4
    model = TorchEagle3(cfg, t, emb)
    with torch.no_grad():
        outs = model.rollout(torch.tensor(tokens[1:]), torch.tensor(feats), steps)
    d2t = t["d2t"]
    for o in range(0, N - steps + 1, 3):
        head = Eagle3Head(cfg, t, tok_embd=emb)
        logits, h = head.decode(tokens[1:o + 2].tolist(), head.encode(feats[:o + 1]))
        for k in range(1, steps + 1):
            np.testing.assert_allclose(outs[k - 1][o + k - 1].numpy(), logits[-1][d2t], atol=1e-4,
                                       err_msg=f"origin {o}, step {k}")
            if k < steps:
                logits, h = head.decode([int(tokens[o + k + 1])], h[-1:])
