"""Tiny DFlash / DSpark heads that draft something a tiny target accepts (tests/test_tree_heads.py):
the random heads of head_cases.build_tiny_head are right almost never. Built by hand and fitted by least
squares (no training) for head_cases' "eagle3" target (8 layers whose residual adds little, layer_scale
0.1), whose next token is mostly a function of the current one: a linear map M from the normed token
embedding to the target's final normed state (recovered from its logits through output.weight, as
eagle_fixtures.fit_tiny_head does) predicts its greedy token ~55% of the time on held-out prompts.

The head (one layer, H 64, 4 heads of 16, own token_embd): block row 1 copies the anchor's normed
embedding and its LM head applies M. How: token_embd is the target's with dim 63 replaced by a flag 1;
the mask token's embedding is the flag alone. fc = 0, so context rows have zero keys and values. Keys
and queries read the flag only (rank 1), on the first RoPE pair of each head (θ = 1 rad per position),
the query turned by −1 rad: every block key is the same vector, and the score of query row i on key row
j is 36·cos(i − j − 1), largest for the row just before (row 1 → the anchor, e^16.6 above itself).
Values and attn_output pass dims 0..62, the FFN adds nothing, so row 1's state is [norm(E[anchor])[:63],
1] and output.weight = output_target · M. Rows ≥ 2 see a mask row (no token dims): zero logits.
DSpark adds the Markov bias w2·w1[prev] = output_target · M · x_prev (rank 64), so every row predicts the
bigram of the token drafted before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from edgespec.backends.llama_cpp import LlamaCppBackend
from edgespec.gguf_file import read_gguf
from edgespec.heads.dflash import DFlashConfig
from edgespec.heads.dflash_gguf import write_dflash_gguf
from edgespec.heads.numpy_ops import rms_norm

H, N_HEAD, HD, EPS = 64, 4, 16, 1e-6


def _state(tok_embd: np.ndarray) -> np.ndarray:
    """Row 1's normed state for each anchor token: RMSNorm([RMSNorm(E'[t])[:63], 1]) (V, 64)."""
    u = rms_norm(tok_embd, np.ones(H, np.float32), EPS)
    u[:, H - 1] = 1.0
    return rms_norm(u, np.ones(H, np.float32), EPS)


def fit_bigram(target_path: Path, prompts: Sequence[str], n_tokens: int = 96,
               ridge: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The copy heads' token_embd (V, H), each anchor's row-1 state (V, H) and LM head (V, H), M fitted on
    the target's greedy continuations of `prompts` (module docstring)."""
    f = read_gguf(target_path)
    w_out, embd = f.tensor("output.weight"), f.tensor("token_embd.weight")  # (V, H) each
    n_vocab = len(w_out)
    own = np.array(embd, np.float32)
    own[:, H - 1] = np.sqrt(np.mean(own[:, : H - 1] ** 2, axis=1))  # the flag, at the tokens' own scale
    own[n_vocab - 1] = 0.0  # the mask token (DFlashConfig.mask_token_id below): the flag alone
    own[n_vocab - 1, H - 1] = 1.0
    x_all = _state(own)
    pinv = np.linalg.solve(w_out.T.astype(np.float64) @ w_out, w_out.T)  # (H, V): logits → final state
    xs, ys = [], []
    with LlamaCppBackend(target_path, n_ctx=512, threads=1) as tgt:
        for p in prompts:
            seq = tgt.tokenize(p)
            tgt.truncate(0)
            tgt.eval(seq[:-1], rows="none")
            for _ in range(n_tokens):
                seq.append(int(np.argmax(tgt.eval(seq[-1:], rows="last")[0])))
            tgt.truncate(0)
            ys.append(tgt.eval(seq[:-1], rows="all").astype(np.float64) @ pinv.T)  # y_P decides seq[P+1]
            xs.append(x_all[seq[:-1], : H - 1].astype(np.float64))
    x, y = np.concatenate(xs), np.concatenate(ys)
    m = np.linalg.solve(x.T @ x + ridge * np.eye(H - 1), x.T @ y)  # (63, H): y ≈ x @ m
    lm = np.zeros((n_vocab, H), np.float32)
    lm[:, : H - 1] = (w_out.astype(np.float64) @ m.T).astype(np.float32)
    return own, x_all, lm


def write_block_copy_head(kind: str, fit: tuple[np.ndarray, np.ndarray, np.ndarray], out: Path,
                          vocab_source: Path) -> Path:
    """Write the "dflash" or "dspark" copy head (module docstring) of `fit` (fit_bigram's)."""
    own, x_all, lm = fit
    n_vocab, mask = len(own), len(own) - 1
    dspark = kind == "dspark"
    cfg = DFlashConfig(n_embd=H, n_layer=1, n_head=N_HEAD, n_head_kv=N_HEAD, n_ff=16, target_layers=(2, 4, 5),
                       n_vocab=n_vocab, n_draft_vocab=n_vocab, mask_token_id=mask, block_size=6, rms_eps=EPS,
                       rope_base=10000.0, markov_rank=H if dspark else 0)
    eye, pair = np.eye(H, dtype=np.float32), np.zeros((N_HEAD * HD, H), np.float32)
    q = pair.copy()
    for h in range(N_HEAD):  # the first RoPE pair of each head (dims 0 and HD/2) reads the flag
        pair[h * HD, H - 1] = 1.0
        q[h * HD, H - 1], q[h * HD + HD // 2, H - 1] = np.cos(-1.0), np.sin(-1.0)
    pass_tokens = eye.copy()
    pass_tokens[H - 1, H - 1] = 0.0
    b = "blk.0."
    t = {"fc.weight": np.zeros((H, 3 * H), np.float32), "enc.output_norm.weight": np.ones(H, np.float32),
         b + "attn_norm.weight": np.ones(H, np.float32), b + "attn_q.weight": q, b + "attn_k.weight": pair,
         b + "attn_v.weight": pass_tokens, b + "attn_output.weight": eye,
         b + "attn_q_norm.weight": np.full(HD, 3.0, np.float32), b + "attn_k_norm.weight": np.full(HD, 3.0, np.float32),
         b + "ffn_norm.weight": np.ones(H, np.float32), b + "ffn_gate.weight": np.zeros((16, H), np.float32),
         b + "ffn_up.weight": np.zeros((16, H), np.float32), b + "ffn_down.weight": np.zeros((H, 16), np.float32),
         "output_norm.weight": np.ones(H, np.float32), "output.weight": lm, "token_embd.weight": own}
    if dspark:
        w1 = np.zeros((n_vocab, H), np.float32)
        w1[:, : H - 1] = x_all[:, : H - 1]
        t |= {"markov_w1.weight": w1, "markov_w2.weight": lm}
    return write_dflash_gguf(out, cfg, t, vocab_source=vocab_source, weight_type="f32",
                             markov_type="f32" if dspark else None)
