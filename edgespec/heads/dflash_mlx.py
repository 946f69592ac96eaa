"""DFlash head on MLX: the function of heads/dflash.py's numpy reference, in mlx.core float32 ops.

Same notation, weights and conventions as dflash.py (read its module docstring): GGUF tensor names
(matrices held transposed, (in, out): heads.mlx_ops.transposed_weights), per-head RMSNorm of q and k,
RoPE in NeoX mode (rotate-half: ``mx.fast.rope`` with ``traditional=False``), a block attending to
the whole context and the whole block (causal inside the block only with ``causal``), d2t scattering
the draft vocabulary's logits into the target's (−inf elsewhere). The context KV cache is one pair of
growing mx arrays (1, n_head_kv, positions, head_dim) per layer, truncated by slicing; a block's own
K/V never enter it. Inputs and outputs are numpy, as for the numpy oracle (tests/head_oracles.py), so DFlashDrafter and
DSparkDrafter (whose Markov head stays numpy) run either unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from edgespec.heads.dflash import DFlashBlocks, DFlashConfig
from edgespec.heads.mlx_ops import (
    MlxHeadWeights,
    merge_heads,
    mx_matrix,
    silu_ffn,
    split_heads,
    to_target_vocab,
)

F32 = npt.NDArray[np.float32]


class MlxDFlashHead(MlxHeadWeights, DFlashBlocks):
    """The DFlash head on MLX, with its context KV cache (target positions 0..n_past−1).

    Args:
        config, tensors, tok_embd: a DFlashConfig, its tensors (see ``DFlashConfig.shapes``) and the
            target's token embeddings, as for heads.mlx_ops.MlxHeadWeights.
        output: the target's LM head (V, H), numpy or mx (used without a copy), used when
            ``tensors`` has neither ``output.weight`` nor ``token_embd.weight`` (llama.cpp ties
            output to an own token_embd).
    """

    config: DFlashConfig

    def __init__(self, config: DFlashConfig, tensors: Mapping[str, npt.NDArray],
                 tok_embd: Any = None, output: Any = None) -> None:
        super().__init__(config, tensors, tok_embd)
        mx = self._mx
        if "output.weight" in self.w:
            self._lm = self.w["output.weight"]  # (H, V_d)
        else:  # a transposed view: the borrowed (or tied) matrix is not copied
            lm = self.tok_embd if "token_embd.weight" in tensors else output
            self._lm = mx_matrix(mx, lm, (config.n_draft_vocab, config.n_embd), "an LM head").T
        kv = (1, config.n_head_kv, 0, config.head_dim)
        self._k = [mx.zeros(kv, mx.float32) for _ in range(config.n_layer)]
        self._v = [mx.zeros(kv, mx.float32) for _ in range(config.n_layer)]
        mx.eval(self._lm, self._k, self._v)  # evaluated where made (mlx_ops.mx_matrix: streams are per thread)

    @property
    def n_past(self) -> int:
        """Target positions whose features are in the context KV cache."""
        return int(self._k[0].shape[2])

    def truncate(self, n_past: int) -> None:
        """Drop the context entries of positions ≥ n_past (after a rejection)."""
        if n_past < self.n_past:
            self._k = [k[:, :, :n_past] for k in self._k]
            self._v = [v[:, :, :n_past] for v in self._v]
            self._mx.eval(self._k, self._v)  # evaluated on this thread (see __init__)

    def _heads(self, y: Any, count: int, norm: str | None, p0: int) -> Any:
        """(n, count·d) → (1, count, n, d); with ``norm``: per-head RMSNorm, then RoPE at p0.."""
        c = self.config
        y = split_heads(y, y.shape[0], count, c.head_dim)
        if norm is None:
            return y
        return self._mx.fast.rope(self._norm(y, norm), c.n_rot, traditional=False, base=c.rope_base,
                                  scale=1.0, offset=p0)

    def _encode(self, features: F32) -> Any:
        c = self.config
        f = np.asarray(features, np.float32)
        if f.ndim != 2 or f.shape[1] != c.n_embd_enc:
            raise ValueError(f"features must be (n, {c.n_embd_enc}) (got {f.shape})")
        return self._norm(self._mx.array(f) @ self.w["fc.weight"], "enc.output_norm.weight")

    def encode(self, features: F32) -> F32:
        """fc then hidden_norm over fused target features: (n, T·H) → g (n, H)."""
        return np.array(self._encode(features))

    def inject(self, features: F32) -> F32:
        """Append target positions n_past.. to the context cache: per layer K = RoPE(k_norm(wk·g)),
        V = wv·g. Returns g (n, H)."""
        c, mx, p0 = self.config, self._mx, self.n_past
        g = self._encode(features)
        for i in range(c.n_layer):
            blk = f"blk.{i}."
            k = self._heads(g @ self.w[blk + "attn_k.weight"], c.n_head_kv, blk + "attn_k_norm.weight", p0)
            v = self._heads(g @ self.w[blk + "attn_v.weight"], c.n_head_kv, None, p0)
            self._k[i] = mx.concatenate([self._k[i], k], axis=2)
            self._v[i] = mx.concatenate([self._v[i], v], axis=2)
        mx.eval(g, self._k, self._v)
        return np.array(g)

    def forward_block(self, tokens: Sequence[int]) -> tuple[F32, F32]:
        """The numpy oracle's forward_block on MLX: (logits (b, V), −inf outside the draft vocabulary; the
        normed hidden (b, H)) of a block at n_past.., the context cache left unchanged."""
        c, mx, w = self.config, self._mx, self.w
        ids = self.check_block(tokens)
        b, p0 = len(ids), self.n_past
        x = self.tok_embd[mx.array(ids.astype(np.int32))].astype(mx.float32)  # (b, H)
        if c.embedding_scale:
            x = x * c.embedding_scale
        scale = c.attention_scale or c.head_dim ** -0.5
        mask = (mx.arange(p0 + b)[None, :] <= mx.arange(p0, p0 + b)[:, None]) if c.causal else None  # (b, p0+b)
        for i in range(c.n_layer):
            blk = f"blk.{i}."
            u = self._norm(x, blk + "attn_norm.weight")
            q = self._heads(u @ w[blk + "attn_q.weight"], c.n_head, blk + "attn_q_norm.weight", p0)
            k = self._heads(u @ w[blk + "attn_k.weight"], c.n_head_kv, blk + "attn_k_norm.weight", p0)
            v = self._heads(u @ w[blk + "attn_v.weight"], c.n_head_kv, None, p0)
            a = mx.fast.scaled_dot_product_attention(q, mx.concatenate([self._k[i], k], axis=2),
                                                     mx.concatenate([self._v[i], v], axis=2), scale=scale,
                                                     mask=mask)
            a = merge_heads(a, b) @ w[blk + "attn_output.weight"]
            if c.value_scale:
                a = a * c.value_scale
            r = x + a
            y = self._norm(r, blk + "ffn_norm.weight")
            x = silu_ffn(mx, y, w[blk + "ffn_gate.weight"], w[blk + "ffn_up.weight"], w[blk + "ffn_down.weight"]) + r
        h = self._norm(x, "output_norm.weight")
        z = h @ self._lm  # (b, V_d)
        mx.eval(z, h)
        return to_target_vocab(np.array(z, np.float32), self.d2t, c.n_vocab), np.array(h)
