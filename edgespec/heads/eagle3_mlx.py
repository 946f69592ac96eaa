"""EAGLE-3 head on MLX: the function of heads/eagle3.py's numpy reference, in mlx.core float32 ops.

Same notation, weights and conventions as eagle3.py (read its module docstring): GGUF tensor names
(matrices held transposed, (in, out), for speed), RoPE in ggml mode 0 (adjacent pairs: ``mx.fast.rope`` with
``traditional=True``; llama3 scaling's ``rope_freqs`` through its ``freqs``), ``norm_before_fc``,
``norm_before_residual``, d2t scattering the draft vocabulary's logits into the target's (−inf elsewhere). The KV cache is a pair of growing mx arrays
(1, n_head_kv, positions, head_dim), truncated by slicing. Inputs and outputs are numpy, as for
Eagle3Head, so EagleDrafter runs either unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from edgespec.heads.eagle3 import BLK, ROPE_FREQS, Eagle3Config, Eagle3Sizes
from edgespec.heads.mlx_ops import MlxHeadWeights, merge_heads, silu_ffn, split_heads, to_target_vocab

F32 = npt.NDArray[np.float32]


class MlxEagle3Head(MlxHeadWeights, Eagle3Sizes):
    """The EAGLE-3 head on MLX, with its own KV cache (positions 0..n_past-1, appended in order).

    Args: ``config`` (an Eagle3Config), ``tensors`` (see ``Eagle3Config.shapes``) and ``tok_embd``,
    as for heads.mlx_ops.MlxHeadWeights.
    """

    config: Eagle3Config

    def __init__(self, config: Eagle3Config, tensors: Mapping[str, npt.NDArray], tok_embd: Any = None) -> None:
        super().__init__(config, tensors, tok_embd)
        mx = self._mx
        kv = (1, config.n_head_kv, 0, config.head_dim)
        self._k, self._v = mx.zeros(kv, mx.float32), mx.zeros(kv, mx.float32)
        mx.eval(self._k, self._v)  # evaluated where made (mlx_ops.mx_matrix: streams are per thread)
        # mx.fast.rope's freqs are periods base^(2i/n_rot) (theta = pos / freqs[i]): llama3's divisors multiply them
        self._freqs = None if ROPE_FREQS not in tensors else mx.array(
            (config.rope_base ** (np.arange(0, config.n_rot, 2) / config.n_rot)
             * np.asarray(tensors[ROPE_FREQS], np.float64)).astype(np.float32))

    @property
    def n_past(self) -> int:
        """Positions in the head's KV cache."""
        return int(self._k.shape[2])

    def truncate(self, n_past: int) -> None:
        """Drop the KV entries of positions ≥ n_past."""
        if n_past < self.n_past:
            self._k, self._v = self._k[:, :, :n_past], self._v[:, :, :n_past]
            self._mx.eval(self._k, self._v)  # evaluated on this thread (see __init__)

    def encode(self, features: F32) -> F32:
        """fc over target features: (n, 3·H_t) → g (n, H)."""
        c, mx = self.config, self._mx
        f = np.asarray(features, np.float32)
        if f.ndim != 2 or f.shape[1] != 3 * c.n_embd_tgt:
            raise ValueError(f"features must be (n, {3 * c.n_embd_tgt}) (got {f.shape})")
        x = mx.array(f)
        if c.norm_before_fc:
            x = self._norm(x, "enc.output_norm.weight")
        return np.array(x @ self.w["fc.weight"])

    def decode(self, tokens: Sequence[int], g: F32, rows: Literal["all", "last"] = "all") -> tuple[F32, F32]:
        """Run the decoder on pairs (tokens[i], g[i]) at positions n_past+i and append their KV.

        Returns (logits (k, V) with −inf outside the draft vocabulary, pre-norm h (k, H)), k = n or 1:
        see Eagle3Head.decode.
        """
        c, mx, w = self.config, self._mx, self.w
        n = len(tokens)
        g_np = np.asarray(g, np.float32)
        if g_np.shape != (n, c.n_embd):
            raise ValueError(f"g must be ({n}, {c.n_embd}) for {n} tokens (got {g_np.shape})")
        p0, hd = self.n_past, c.head_dim
        e = self.tok_embd[mx.array(np.asarray(tokens, np.int32))].astype(mx.float32)
        e = self._norm(e, BLK + "attn_norm.weight")
        gx = mx.array(g_np)
        gn = self._norm(gx, BLK + "attn_norm_2.weight")
        x = mx.concatenate([e, gn], axis=1)  # (n, 2H)

        def heads(y: Any, count: int) -> Any:  # (n, count·d) → (1, count, n, d), RoPE'd at p0..p0+n-1
            return mx.fast.rope(split_heads(y, n, count, hd), c.n_rot, traditional=True,
                                base=None if self._freqs is not None else c.rope_base, scale=1.0, offset=p0,
                                freqs=self._freqs)

        q = heads(x @ w[BLK + "attn_q.weight"], c.n_head)
        k = heads(x @ w[BLK + "attn_k.weight"], c.n_head_kv)
        v = split_heads(x @ w[BLK + "attn_v.weight"], n, c.n_head_kv, hd)
        self._k = mx.concatenate([self._k, k], axis=2)
        self._v = mx.concatenate([self._v, v], axis=2)
        mask = mx.arange(p0 + n)[None, :] <= mx.arange(p0, p0 + n)[:, None]  # (n, p0+n): causal
        a = mx.fast.scaled_dot_product_attention(q, self._k, self._v, scale=hd ** -0.5, mask=mask)
        r = merge_heads(a, n) @ w[BLK + "attn_output.weight"] + (gn if c.norm_before_residual else gx)
        y = self._norm(r, BLK + "ffn_norm.weight")
        h = silu_ffn(mx, y, w[BLK + "ffn_gate.weight"], w[BLK + "ffn_up.weight"], w[BLK + "ffn_down.weight"]) + r
        if rows == "last":
            h = h[-1:]
        z = self._norm(h, "output_norm.weight") @ w["output.weight"]  # (k, V_d)
        mx.eval(z, h, self._k, self._v)
        return to_target_vocab(np.array(z), self.d2t, c.n_vocab), np.array(h)

    def decode_tree(self, tokens: Sequence[int], g: F32, positions: Sequence[int],
                    visible: npt.NDArray[np.bool_]) -> tuple[F32, F32]:
        """EAGLE-2's batched tree step: pairs (tokens[i], g[i]) at their own positions, each attending to
        the cache entries `visible[i]` marks ((n, n_past + n) bool: the entries held, then the n new ones),
        appended after the cache in row order (entry order, not position order: a tree's nodes). The rows
        go in the batch axis with per-row RoPE offsets and the mask, as backends/mlx_tree.py runs a target.

        Returns (logits (n, V) with −inf outside the draft vocabulary, pre-norm h (n, H)), every row.
        """
        c, mx, w = self.config, self._mx, self.w
        n, hd = len(tokens), c.head_dim
        g_np = np.asarray(g, np.float32)
        p_all = self.n_past + n
        if g_np.shape != (n, c.n_embd) or len(positions) != n or np.shape(visible) != (n, p_all):
            raise ValueError(f"decode_tree: {n} tokens need g ({n}, {c.n_embd}), {n} positions and a ({n}, {p_all}) "
                             f"mask (got {g_np.shape}, {len(positions)}, {np.shape(visible)})")
        e = self._norm(self.tok_embd[mx.array(np.asarray(tokens, np.int32))].astype(mx.float32), BLK + "attn_norm.weight")
        gx = mx.array(g_np)
        gn = self._norm(gx, BLK + "attn_norm_2.weight")
        x = mx.concatenate([e, gn], axis=1)  # (n, 2H)
        offset = mx.array(np.asarray(positions, np.int32))

        def heads(y: Any, count: int) -> Any:  # (n, count·d) → (n, count, 1, d), row i RoPE'd at positions[i]
            return mx.fast.rope(y.reshape(n, count, 1, hd), c.n_rot, traditional=True,
                                base=None if self._freqs is not None else c.rope_base, scale=1.0, offset=offset,
                                freqs=self._freqs)

        q = heads(x @ w[BLK + "attn_q.weight"], c.n_head)
        k = heads(x @ w[BLK + "attn_k.weight"], c.n_head_kv)
        v = (x @ w[BLK + "attn_v.weight"]).reshape(n, c.n_head_kv, 1, hd)
        self._k = mx.concatenate([self._k, k.transpose(2, 1, 0, 3)], axis=2)  # (1, kv heads, n_past + n, d)
        self._v = mx.concatenate([self._v, v.transpose(2, 1, 0, 3)], axis=2)
        shape = (n, c.n_head_kv, p_all, hd)
        mask = mx.array(np.asarray(visible, bool))[:, None, None, :]  # (n, 1, 1, n_past + n)
        a = mx.fast.scaled_dot_product_attention(q, mx.broadcast_to(self._k, shape), mx.broadcast_to(self._v, shape),
                                                 scale=hd ** -0.5, mask=mask)  # (n, heads, 1, d)
        r = a.reshape(n, c.n_head * hd) @ w[BLK + "attn_output.weight"] + (gn if c.norm_before_residual else gx)
        y = self._norm(r, BLK + "ffn_norm.weight")
        h = silu_ffn(mx, y, w[BLK + "ffn_gate.weight"], w[BLK + "ffn_up.weight"], w[BLK + "ffn_down.weight"]) + r
        z = self._norm(h, "output_norm.weight") @ w["output.weight"]  # (n, V_d)
        mx.eval(z, h, self._k, self._v)
        return to_target_vocab(np.array(z), self.d2t, c.n_vocab), np.array(h)
