"""EAGLE-3 heads built by hand for drafter tests (no training): heads whose drafts are right often.

Both heads use one decoder trick: q = k = c·[norm(embed(token)); 0] and v = [norm(embed(token)); 0],
so each position attends (up to e^-20 or less) to itself and to earlier copies of its own token,
whose values are the same: the attention output is norm(embed(t_{P+1})) exactly, whatever the RoPE
position. The FFN adds nothing (ffn_down = 0), so h = attn_output · norm(embed(t_{P+1})) + fc · f_P
and the logits are output · norm(h): linear in what the head sees, up to the norm's positive scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from edgespec.backends.llama_features import LlamaFeatureBackend
from edgespec.backends.reference import ReferenceFeatureBackend
from edgespec.gguf_file import read_gguf
from edgespec.heads.eagle3 import BLK, Eagle3Config, Eagle3Head
from edgespec.heads.gguf_io import write_eagle3_gguf
from edgespec.heads.numpy_ops import rms_norm


def _token_passing_decoder(n_embd: int, n_ff: int, c: float) -> dict[str, npt.NDArray[np.float32]]:
    """blk.0.* of a decoder whose attention returns norm(embed(t)) of its own token (see module doc)."""
    eye = np.concatenate([np.eye(n_embd), np.zeros((n_embd, n_embd))], axis=1).astype(np.float32)  # (H, 2H)
    ones = np.ones(n_embd, np.float32)
    return {BLK + "attn_norm.weight": ones, BLK + "attn_norm_2.weight": ones, BLK + "ffn_norm.weight": ones,
            BLK + "attn_q.weight": c * eye, BLK + "attn_k.weight": c * eye, BLK + "attn_v.weight": eye,
            BLK + "ffn_gate.weight": np.zeros((n_ff, n_embd), np.float32),
            BLK + "ffn_up.weight": np.zeros((n_ff, n_embd), np.float32),
            BLK + "ffn_down.weight": np.zeros((n_embd, n_ff), np.float32)}


def reference_head(target: ReferenceFeatureBackend, *, noise: float = 0.0, d2t: Sequence[int] | None = None,
                   seed: int = 0) -> Eagle3Head:
    """A head for a ReferenceFeatureBackend whose first-step logits are exactly the target's next
    logits on the draft vocabulary (noise = 0), plus noise·N(0, 2) per logit otherwise.

    Layout (H = 32): embed(t) = e_{2t} (each token in its own RoPE pair, so different tokens never
    attend to each other), h = s·[one-hot(t_{P+1}) (V); one-hot(t_P) (V); 0], and output reads
    w1[t_{P+1}] + w2[t_P] off those blocks: the reference target's next-token logits. Chain steps feed
    h back as g, so later drafts see a blurred context and are right less often (as for a real head).
    """
    V, H = target.n_vocab, 32
    if 2 * V > H:
        raise ValueError(f"reference_head supports n_vocab <= {H // 2} (got {V})")
    d2t_arr = np.arange(V) if d2t is None else np.asarray(sorted(d2t), np.int64)
    cfg = Eagle3Config(n_embd=H, n_head=1, n_head_kv=1, n_ff=8, n_embd_tgt=target.n_embd, target_layers=(1, 2, 3),
                       n_vocab=V, n_draft_vocab=len(d2t_arr))
    t = _token_passing_decoder(H, cfg.n_ff, c=3.0)  # self score 9·32/√32 ≈ 51, other tokens 0
    tok_embd = np.zeros((V, H), np.float32)
    tok_embd[np.arange(V), 2 * np.arange(V)] = 1.0  # norm(embed(t)) = √H · e_{2t}
    wo = np.zeros((H, H), np.float32)
    wo[np.arange(V), 2 * np.arange(V)] = 1.0 / np.sqrt(H)  # → one-hot(t_{P+1}) in h[0:V]
    fc = np.zeros((H, 3 * target.n_embd), np.float32)
    fc[V + np.arange(V), np.arange(V)] = 1.0  # feature block 0 = one-hot(t_P) → h[V:2V]
    scale = np.sqrt(H / 2)  # norm(h) puts √(H/2) on each of its two ones
    out = np.zeros((len(d2t_arr), H), np.float32)
    out[:, :V] = target.w1[:, d2t_arr].T / scale
    out[:, V:2 * V] = target.w2[:V, d2t_arr].T / scale
    out += noise * np.random.default_rng(seed).standard_normal(out.shape).astype(np.float32) / scale
    t |= {"fc.weight": fc, BLK + "attn_output.weight": wo, "output_norm.weight": np.ones(H, np.float32),
          "output.weight": out}
    if len(d2t_arr) < V:
        t["d2t"] = d2t_arr
    return Eagle3Head(cfg, t, tok_embd=tok_embd)


def fit_tiny_head(target_path: Path, out: Path, vocab_source: Path, prompts: Sequence[str], n_tokens: int = 96,
                  ridge: float = 1.0) -> Path:
    """Write an F32 head for an 8-layer, n_embd-64 tiny llama, fitted by least squares (no training).

    The target's greedy continuations of `prompts` give, per position P, its features f_P, its own
    final normed state y_P (recovered from its logits through output.weight, which has full column
    rank; y_P decides t_{P+1}) and norm(embed(t_P)). Two ridge regressions, in EAGLE's spirit that h
    predicts the next position's state:
      1. fc: f_P → y_P ("features → next token"), so s_P = norm(fc · f_P) ≈ y_P;
      2. [A, D]: (norm(embed(t_{P+1})), s_P) → y_{P+1}, put in attn_output.
    With norm_before_residual and attn_norm_2 = ε, the residual takes only ε·norm(g), and the
    attention's second head returns norm(g)/... exactly (v = [norm(embed(t)); norm(g)/ε]), so
    h = A·norm(embed(t_{P+1})) + D·s_P (+ ε·s_P) ≈ y_{P+1}: the logits' state, and a state to feed
    back as the next g (norm(h) ≈ s_{P+1}), so chain steps stay on track.
    """
    f = read_gguf(target_path)
    w_out, embd = f.tensor("output.weight"), f.tensor("token_embd.weight")  # (V, H) each
    pinv = np.linalg.solve(w_out.T.astype(np.float64) @ w_out, w_out.T).astype(np.float32)  # (H, V)
    feats, ys, es = [], [], []
    with LlamaFeatureBackend(target_path, layers=(2, 4, 5), n_ctx=512, threads=1) as tgt:
        H = tgt.n_embd
        for p in prompts:
            seq = tgt.tokenize(p)
            tgt.truncate(0)
            tgt.eval(seq[:-1], rows="none")
            for _ in range(n_tokens):  # greedy, one token at a time (plain decoding)
                seq.append(int(np.argmax(tgt.eval(seq[-1:], rows="last")[0])))
            tgt.truncate(0)
            ys.append((tgt.eval(seq, rows="all") @ pinv.T).astype(np.float64))  # (n, H)
            feats.append(tgt.features().astype(np.float64))
            es.append(rms_norm(embd[seq], np.ones(H, np.float32), 1e-5).astype(np.float64))

    def ridge_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:  # y ≈ x @ w
        return np.linalg.solve(x.T @ x + ridge * np.eye(x.shape[1]), x.T @ y)

    fc = ridge_fit(np.concatenate(feats), np.concatenate(ys)).T  # (H, 3H)
    s = [rms_norm((fp @ fc.T).astype(np.float32), np.ones(H, np.float32), 1e-5) for fp in feats]
    z = np.concatenate([np.concatenate([e[1:], sp[:-1]], axis=1) for e, sp in zip(es, s)])
    w = ridge_fit(z, np.concatenate([y[1:] for y in ys])).T  # (H, 2H): [A, D]
    eps = 1e-3
    cfg = Eagle3Config(n_embd=H, n_head=2, n_head_kv=2, n_ff=64, n_embd_tgt=H, target_layers=(2, 4, 5),
                       n_vocab=len(w_out), n_draft_vocab=len(w_out), head_dim=H, norm_before_residual=True)
    t = _token_passing_decoder(H, cfg.n_ff, c=2.5)  # self score 6.25·64/8 = 50, others N(0, 6.25²)
    eye, zero = np.eye(H, dtype=np.float32), np.zeros((H, H), np.float32)
    qk = 2.5 * np.block([[eye, zero], [eye, zero]])  # both heads attend by the token alone
    w[:, H:] -= eps * np.eye(H)  # cancels the residual's ε·norm(g)
    t |= {BLK + "attn_q.weight": qk, BLK + "attn_k.weight": qk,
          BLK + "attn_v.weight": np.block([[eye, zero], [zero, eye / eps]]),
          BLK + "attn_norm_2.weight": np.full(H, eps, np.float32),
          "fc.weight": fc.astype(np.float32), BLK + "attn_output.weight": w.astype(np.float32),
          "output_norm.weight": np.ones(H, np.float32), "output.weight": w_out}
    return write_eagle3_gguf(out, cfg, t, vocab_source=vocab_source, weight_type="f32")
