"""Numpy oracles of the feature heads, owned by the tests: the DFlash forward (llama.cpp's dflash graph,
src/models/dflash.cpp 0.3.36; see edgespec.heads.dflash for the notation) that the libllama and MLX
heads are compared against, and `oracle_drafter`, a head GGUF's drafter on these numpy forwards (the
EAGLE-3 one is edgespec.heads.eagle3.Eagle3Head, which edgespec.train.evaluate also runs). Not a
product runtime: a numpy chain step costs ~56 ms where libllama's costs 0.9 ms (docs/heads.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from edgespec.backends.base import FeatureBackend
from edgespec.drafters.heads import read_head
from edgespec.gguf_file import read_gguf
from edgespec.heads.dflash import _LAYER, DFlashBlocks, DFlashConfig
from edgespec.heads.numpy_ops import NumpyHeadWeights, attention, rms_norm, silu

F32 = npt.NDArray[np.float32]
RTOL = 1e-4  # max |runtime − oracle| over the oracle's range (float32 heads vs the oracle's float64)


def close_rel(got: np.ndarray, want: np.ndarray, rtol: float = RTOL) -> float:
    """Relative max difference on the finite entries (the −inf pattern must be identical), at most `rtol`."""
    fin = np.isfinite(want)
    assert got.shape == want.shape and np.array_equal(np.isfinite(got), fin)
    diff = float(np.abs(got[fin] - want[fin]).max() / (want[fin].max() - want[fin].min()))
    assert diff <= rtol, diff
    return diff


def oracle_drafter(path: str | Path, target: FeatureBackend) -> Any:
    """The drafter of head GGUF `path` on the numpy oracles, borrowing what the head lacks from the
    target's GGUF (as numpy arrays), as open_drafter builds the runtime ones."""
    from edgespec.drafters.dflash import DFlashDrafter
    from edgespec.drafters.dspark import DSparkDrafter
    from edgespec.drafters.eagle import EagleDrafter
    from edgespec.heads.dflash_gguf import read_dflash_gguf
    from edgespec.heads.dspark import MarkovHead
    from edgespec.heads.eagle3 import Eagle3Head
    from edgespec.heads.gguf_io import read_eagle3_gguf

    head = read_head(path)
    assert head is not None, path
    t = read_gguf(target.path)
    embd = t.tensor("token_embd.weight")
    if head.arch == "eagle3":
        config, tensors = read_eagle3_gguf(head.file)
        return EagleDrafter(Eagle3Head(config, tensors, tok_embd=embd), target, head.path)
    config, tensors = read_dflash_gguf(head.file)
    output = t.tensor("output.weight") if "output.weight" in t.tensors else embd
    runner = DFlashHead(config, tensors, tok_embd=embd, output=output)
    if head.variant == "dspark":
        return DSparkDrafter(runner, target, MarkovHead(config, tensors), head.path)
    return DFlashDrafter(runner, target, head.path)


class DFlashHead(DFlashBlocks, NumpyHeadWeights):
    """The DFlash head in numpy, with its context KV cache (target positions 0..n_past−1).

    Args:
        config, tensors, tok_embd: as for NumpyHeadWeights.
        output: the target's LM head (V, H), used when ``tensors`` has neither ``output.weight``
            nor ``token_embd.weight`` (llama.cpp ties output to an own token_embd).
    """

    def __init__(self, config: DFlashConfig, tensors: Mapping[str, npt.NDArray],
                 tok_embd: F32 | None = None, output: F32 | None = None) -> None:
        super().__init__(config, tensors, tok_embd)
        head = self.tensors.get("output.weight", self.tensors.get("token_embd.weight", output))
        if head is None or head.shape != (config.n_draft_vocab, config.n_embd):
            raise ValueError(f"the head needs an LM head of shape {(config.n_draft_vocab, config.n_embd)} "
                             f"(its own or the target's; got {None if head is None else head.shape})")
        self.lm_head = np.asarray(head, np.float32)
        shape = (0, config.n_head_kv, config.head_dim)
        self._k = [np.empty(shape, np.float32) for _ in range(config.n_layer)]  # per layer (positions, kv heads, d)
        self._v = [np.empty(shape, np.float32) for _ in range(config.n_layer)]

    @property
    def n_past(self) -> int:
        """Target positions whose features are in the context KV cache."""
        return len(self._k[0])

    def close(self) -> None:
        """Nothing to free (the arrays go with the object); LlamaDFlashHead frees its handles."""

    def truncate(self, n_past: int) -> None:
        """Drop the context entries of positions ≥ n_past (after a rejection)."""
        self._k = [k[:n_past] for k in self._k]
        self._v = [v[:n_past] for v in self._v]

    def encode(self, features: F32) -> F32:
        """fc then hidden_norm over fused target features: (n, T·H) → g (n, H)."""
        c, t = self.config, self.tensors
        f = np.asarray(features, np.float32)
        if f.ndim != 2 or f.shape[1] != c.n_embd_enc:
            raise ValueError(f"features must be (n, {c.n_embd_enc}) (got {f.shape})")
        return rms_norm(mm(f, t["fc.weight"]), t["enc.output_norm.weight"], c.rms_eps)

    def inject(self, features: F32) -> F32:
        """Append target positions n_past.. to the context cache (llama.cpp's embd-batch decode):
        per layer K = RoPE(k_norm(wk·g)), V = wv·g. Returns g (n, H)."""
        c, t = self.config, self.tensors
        g = self.encode(features)
        n = len(g)
        pos = np.arange(self.n_past, self.n_past + n, dtype=np.int64)
        for i in range(c.n_layer):
            k = mm(g, t[f"blk.{i}.attn_k.weight"]).reshape(n, c.n_head_kv, c.head_dim)
            k = rope_neox(rms_norm(k, t[f"blk.{i}.attn_k_norm.weight"], c.rms_eps), pos, c.n_rot, c.rope_base)
            v = mm(g, t[f"blk.{i}.attn_v.weight"]).reshape(n, c.n_head_kv, c.head_dim)
            self._k[i], self._v[i] = np.concatenate([self._k[i], k]), np.concatenate([self._v[i], v])
        return g

    def forward_block(self, tokens: Sequence[int]) -> tuple[F32, F32]:
        """The decoder on a block at positions n_past..n_past+b−1, attending to the whole context
        cache and the whole block; the cache is left unchanged.

        Args:
            tokens: b ≤ block_size target ids, normally ``block_tokens(t_last)``.

        Returns:
            (logits (b, V) with −inf outside the draft vocabulary, the normed hidden (b, H)).
        """
        c, t = self.config, self.tensors
        ids = self.check_block(tokens)
        b = len(ids)
        x = self.tok_embd[ids]
        if c.embedding_scale:
            x = (x * np.float32(c.embedding_scale)).astype(np.float32)
        pos = np.arange(self.n_past, self.n_past + b, dtype=np.int64)
        kpos = np.arange(self.n_past + b, dtype=np.int64)
        scale = c.attention_scale or 1.0 / np.sqrt(c.head_dim)
        for i in range(c.n_layer):
            w = {k: t[f"blk.{i}.{k}.weight"] for k in _LAYER}
            u = rms_norm(x, w["attn_norm"], c.rms_eps)
            q = rms_norm(mm(u, w["attn_q"]).reshape(b, c.n_head, c.head_dim), w["attn_q_norm"], c.rms_eps)
            k = rms_norm(mm(u, w["attn_k"]).reshape(b, c.n_head_kv, c.head_dim), w["attn_k_norm"], c.rms_eps)
            v = mm(u, w["attn_v"]).reshape(b, c.n_head_kv, c.head_dim)
            q, k = rope_neox(q, pos, c.n_rot, c.rope_base), rope_neox(k, pos, c.n_rot, c.rope_base)
            a = attention(q, np.concatenate([self._k[i], k]), np.concatenate([self._v[i], v]), pos, kpos,
                          scale, c.causal)
            a = mm(a, w["attn_output"])
            if c.value_scale:
                a = (a * np.float32(c.value_scale)).astype(np.float32)
            r = (a.astype(np.float64) + x).astype(np.float32)
            y = rms_norm(r, w["ffn_norm"], c.rms_eps)
            ff = silu(mm(y, w["ffn_gate"])) * mm(y, w["ffn_up"])
            x = (mm(ff, w["ffn_down"]).astype(np.float64) + r).astype(np.float32)
        h = rms_norm(x, t["output_norm.weight"], c.rms_eps)
        logits = np.full((b, c.n_vocab), -np.inf, np.float32)
        logits[:, self.d2t] = mm(h, self.lm_head)
        return logits, h


def rope_neox(x: F32, positions: npt.NDArray[np.int64], n_rot: int, base: float) -> F32:
    """ggml_rope_ext in NeoX mode (LLAMA_ROPE_TYPE_NEOX): rotate pairs (x[i], x[i + n_rot/2]) by
    pos·base^(−2i/n_rot); dims ≥ n_rot pass through. x: (n, heads, head_dim)."""
    half = n_rot // 2
    theta = positions.astype(np.float64)[:, None] * base ** (-2.0 * np.arange(half, dtype=np.float64) / n_rot)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    out = x.astype(np.float64).copy()
    x0, x1 = out[..., :half].copy(), out[..., half:n_rot].copy()
    out[..., :half] = x0 * cos - x1 * sin
    out[..., half:n_rot] = x0 * sin + x1 * cos
    return out.astype(np.float32)


def mm(x: npt.NDArray, w: F32) -> F32:
    """x · wᵀ in float64, as float32 (w in GGUF/numpy layout: (out, in))."""
    return (np.asarray(x, np.float64) @ w.T.astype(np.float64)).astype(np.float32)
