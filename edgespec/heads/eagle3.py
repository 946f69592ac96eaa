"""EAGLE-3 head: its config and tensor layout, and a numpy forward of llama.cpp's eagle3 architecture
(src/models/eagle3.cpp, 0.3.36). Heads draft on libllama (heads/eagle3_llama.py) or MLX
(heads/eagle3_mlx.py); the numpy Eagle3Head is the oracle they are tested against and what
edgespec.train.evaluate runs without torch, not a drafter runtime (~56 ms a chain step against 0.9 ms
on libllama: docs/heads.md).

Notation: H = head hidden size, H_t = target hidden size, V = target vocabulary, V_d = draft
vocabulary. Weights are kept under their GGUF tensor names with numpy shape = reversed GGUF ne
(``blk.0.attn_q.weight`` is (n_head·head_dim, 2H)), so no renaming table exists between this
module, the GGUF file and llama.cpp.

Encoder (one row per target position p): g_p = fc · f_p, with f_p = [h_low; h_mid; h_high] (3·H_t)
the target features (``norm_before_fc``: f_p is RMS-normed and scaled by enc.output_norm first).

Decoder at head position P takes the pair (t_{P+1}, g_P) and predicts t_{P+2}:
  e = RMSNorm(E[t_{P+1}]) · attn_norm, n = RMSNorm(g_P) · attn_norm_2       (E: the target's
  x = [e; n] (2H) → q, k, v; RoPE at P (ggml mode 0, adjacent pairs);        token embeddings
  causal attention over the head's own KV cache (positions 0..P);           unless the head
  r = attn · wo + g_P (``norm_before_residual``: + n); h = r + FFN(RMSNorm(r)·ffn_norm)   has its own)
  logits over V_d = output · (RMSNorm(h) · output_norm), scattered to V by d2t (others −inf).
The pre-norm h is the next g when the head drafts on from its own output (common/speculative.cpp).
A head with ``rope_freqs.weight`` (llama3 RoPE scaling, from a Llama-3.1 head's config) divides
each pair's inverse frequency by it, as ggml_rope_ext does with its freq_factors.

As in llama.cpp, the decoder needs H == H_t when it borrows the target's token embeddings.
GGUF Q/K rows are in ggml's interleaved-RoPE order: weights trained here keep that convention.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from edgespec.heads.numpy_ops import NumpyHeadWeights, attention, rms_norm, rope_norm, silu

F32 = npt.NDArray[np.float32]
BLK = "blk.0."
ROPE_FREQS = "rope_freqs.weight"  # optional: llama3 RoPE scaling, theta_i = pos·base^(−2i/n_rot) / rope_freqs[i]


@dataclass(frozen=True)
class Eagle3Config:
    """Hyperparameters of an EAGLE-3 head (the eagle3.* keys of its GGUF)."""

    n_embd: int  # H
    n_head: int
    n_head_kv: int
    n_ff: int
    n_embd_tgt: int  # H_t
    target_layers: tuple[int, ...]  # 3 target layer ids (features = input of each layer)
    n_vocab: int  # V: the target's vocabulary
    n_draft_vocab: int  # V_d (== V when the head has no d2t)
    head_dim: int = 0  # 0: n_embd // n_head
    rms_eps: float = 1e-5
    rope_base: float = 10000.0
    n_rot: int = 0  # 0: head_dim
    context_length: int = 2048
    norm_before_residual: bool = False
    norm_before_fc: bool = False

    def __post_init__(self) -> None:
        for name in ("rms_eps", "rope_base"):  # stored as GGUF float32: keep round trips exact
            object.__setattr__(self, name, float(np.float32(getattr(self, name))))
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.n_embd // self.n_head)
        if self.n_rot == 0:
            object.__setattr__(self, "n_rot", self.head_dim)
        if len(self.target_layers) != 3:
            raise ValueError(f"EAGLE-3 needs exactly 3 target layers (got {self.target_layers})")
        if self.n_head % self.n_head_kv or self.n_rot % 2 or self.n_rot > self.head_dim:
            raise ValueError(f"bad attention shape: n_head={self.n_head} n_head_kv={self.n_head_kv} "
                             f"head_dim={self.head_dim} n_rot={self.n_rot}")
        if not 0 < self.n_draft_vocab <= self.n_vocab:
            raise ValueError(f"n_draft_vocab must be in 1..n_vocab={self.n_vocab} (got {self.n_draft_vocab})")

    def shapes(self, own_embd: bool = False, rope_freqs: bool = False) -> dict[str, tuple[int, ...]]:
        """GGUF tensor name → numpy shape of every tensor the head carries (d2t only if V_d < V;
        ``rope_freqs``: the llama3 RoPE scaling divisors, one per rotated pair)."""
        H, qd, kvd = self.n_embd, self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        s: dict[str, tuple[int, ...]] = {"fc.weight": (H, 3 * self.n_embd_tgt)}
        if self.norm_before_fc:
            s["enc.output_norm.weight"] = (3 * self.n_embd_tgt,)
        s |= {BLK + "attn_norm.weight": (H,), BLK + "attn_norm_2.weight": (H,),
              BLK + "attn_q.weight": (qd, 2 * H), BLK + "attn_k.weight": (kvd, 2 * H),
              BLK + "attn_v.weight": (kvd, 2 * H), BLK + "attn_output.weight": (H, qd),
              BLK + "ffn_norm.weight": (H,), BLK + "ffn_gate.weight": (self.n_ff, H),
              BLK + "ffn_up.weight": (self.n_ff, H), BLK + "ffn_down.weight": (H, self.n_ff),
              "output_norm.weight": (H,), "output.weight": (self.n_draft_vocab, H)}
        if self.n_draft_vocab < self.n_vocab:
            s["d2t"] = (self.n_draft_vocab,)
        if own_embd:
            s["token_embd.weight"] = (self.n_vocab, H)
        if rope_freqs:
            s[ROPE_FREQS] = (self.n_rot // 2,)
        return s

    def check_tensors(self, tensors: Mapping[str, npt.NDArray]) -> None:
        """ValueError naming the first missing, unknown or misshapen tensor."""
        want = self.shapes(own_embd="token_embd.weight" in tensors, rope_freqs=ROPE_FREQS in tensors)
        for name, shape in want.items():
            if name not in tensors:
                raise ValueError(f"EAGLE-3 head lacks tensor {name} {shape}")
            if tuple(tensors[name].shape) != shape:
                raise ValueError(f"tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}")
        extra = sorted(set(tensors) - set(want))
        if extra:
            raise ValueError(f"unknown EAGLE-3 tensors: {', '.join(extra)}")
        if "d2t" in tensors:
            d2t = np.asarray(tensors["d2t"])
            if d2t.min() < 0 or d2t.max() >= self.n_vocab or len(np.unique(d2t)) != len(d2t):
                raise ValueError(f"d2t must hold distinct target ids in 0..{self.n_vocab - 1}")
        if ROPE_FREQS in tensors and not np.all(np.asarray(tensors[ROPE_FREQS]) > 0):
            raise ValueError(f"{ROPE_FREQS} must hold positive divisors (got {np.asarray(tensors[ROPE_FREQS]).min()})")


def random_tensors(config: Any, seed: int = 0, d2t: npt.NDArray[np.int64] | None = None,
                   std: float = 1.0, own_embd: bool = False) -> dict[str, npt.NDArray]:
    """A randomly initialised head (Eagle3Config or DFlashConfig): norms = 1, matrices ~
    N(0, std²/fan_in), d2t = ``d2t`` or the first V_d target ids; ``own_embd`` adds a token_embd
    (V, H) ~ N(0, 1)."""
    rng = np.random.default_rng(seed)
    out: dict[str, npt.NDArray] = {}
    for name, shape in config.shapes(own_embd=own_embd).items():
        if name == "d2t":
            out[name] = np.arange(config.n_draft_vocab, dtype=np.int64) if d2t is None else np.asarray(d2t, np.int64)
        elif len(shape) == 1:
            out[name] = np.ones(shape, np.float32)
        elif name == "token_embd.weight":
            out[name] = rng.standard_normal(shape, dtype=np.float32)
        else:
            out[name] = (rng.standard_normal(shape, dtype=np.float32) * np.float32(std / np.sqrt(shape[1])))
    return out


def config_property(name: str, doc: str) -> Any:
    """A read-only property giving ``self.config.<name>`` (what a head runner reads from its config)."""
    return property(lambda self: getattr(self.config, name), doc=doc)


class Eagle3Sizes:
    """The sizes an in-process EAGLE-3 runner reads from its config (Eagle3Head here,
    heads.eagle3_mlx.MlxEagle3Head; LlamaEagle3Head has the same attributes from its model)."""

    config: Eagle3Config

    n_embd = config_property("n_embd", "H, the width of g and h.")
    n_embd_tgt = config_property("n_embd_tgt", "H_t, the target's hidden size (a feature row is 3·H_t wide).")
    n_vocab = config_property("n_vocab", "V, the target's vocabulary (the width of the logits).")

    def close(self) -> None:
        """Nothing to free (the arrays go with the object); LlamaEagle3Head frees its handles."""


class Eagle3Head(Eagle3Sizes, NumpyHeadWeights):
    """The EAGLE-3 head in numpy, with its own KV cache (positions 0..n_past-1, appended in order);
    constructed from (config, tensors, tok_embd) as NumpyHeadWeights."""

    def __init__(self, config: Eagle3Config, tensors: Mapping[str, npt.NDArray],
                 tok_embd: F32 | None = None) -> None:
        super().__init__(config, tensors, tok_embd)
        self._k = np.empty((0, config.n_head_kv, config.head_dim), np.float32)  # (positions, kv heads, d)
        self._v = np.empty((0, config.n_head_kv, config.head_dim), np.float32)

    @property
    def n_past(self) -> int:
        """Positions in the head's KV cache."""
        return len(self._k)

    def truncate(self, n_past: int) -> None:
        """Drop the KV entries of positions ≥ n_past."""
        self._k, self._v = self._k[:n_past], self._v[:n_past]

    def kv_state(self) -> tuple[F32, F32]:
        """The KV cache (k, v), each (n_past, n_head_kv, head_dim). The arrays are never written in
        place, so ``set_kv_state`` of a saved state rewinds the head to it (even past a truncate)."""
        return self._k, self._v

    def set_kv_state(self, state: tuple[F32, F32]) -> None:
        """Make ``state`` (from ``kv_state``) the KV cache."""
        self._k, self._v = state

    def encode(self, features: F32) -> F32:
        """fc over target features: (n, 3·H_t) → g (n, H)."""
        c, t = self.config, self.tensors
        f = np.asarray(features, np.float32)
        if f.ndim != 2 or f.shape[1] != 3 * c.n_embd_tgt:
            raise ValueError(f"features must be (n, {3 * c.n_embd_tgt}) (got {f.shape})")
        if c.norm_before_fc:
            f = rms_norm(f, t["enc.output_norm.weight"], c.rms_eps)
        return (f.astype(np.float64) @ t["fc.weight"].T.astype(np.float64)).astype(np.float32)

    def decode(self, tokens: Sequence[int], g: F32, rows: Literal["all", "last"] = "all") -> tuple[F32, F32]:
        """Run the decoder on pairs (tokens[i], g[i]) at positions n_past+i and append their KV.

        Args:
            tokens: the token after each g's position (t_{P+1}), target ids.
            g: (n, H): encoder outputs, or the head's own previous pre-norm outputs.
            rows: outputs for every pair, or only the last (the LM head dominates the cost).

        Returns:
            (logits, h): logits (k, V) float32 with −inf outside the draft vocabulary, and the
            pre-norm hidden states h (k, H) that feed the next drafting step; k = n or 1.
        """
        c, t = self.config, self.tensors
        g = np.asarray(g, np.float32)
        n = len(tokens)
        if g.shape != (n, c.n_embd):
            raise ValueError(f"g must be ({n}, {c.n_embd}) for {n} tokens (got {g.shape})")
        pos = np.arange(self.n_past, self.n_past + n, dtype=np.int64)
        e = rms_norm(self.tok_embd[np.asarray(tokens, np.int64)], t[BLK + "attn_norm.weight"], c.rms_eps)
        gn = rms_norm(g, t[BLK + "attn_norm_2.weight"], c.rms_eps)
        x = np.concatenate([e, gn], axis=1).astype(np.float64)  # (n, 2H)
        q = (x @ t[BLK + "attn_q.weight"].T).astype(np.float32).reshape(n, c.n_head, c.head_dim)
        k = (x @ t[BLK + "attn_k.weight"].T).astype(np.float32).reshape(n, c.n_head_kv, c.head_dim)
        v = (x @ t[BLK + "attn_v.weight"].T).astype(np.float32).reshape(n, c.n_head_kv, c.head_dim)
        ff = t.get(ROPE_FREQS)
        q, k = rope_norm(q, pos, c.n_rot, c.rope_base, ff), rope_norm(k, pos, c.n_rot, c.rope_base, ff)
        self._k, self._v = np.concatenate([self._k, k]), np.concatenate([self._v, v])
        kpos = np.arange(self.n_past, dtype=np.int64)
        a = attention(q, self._k, self._v, pos, kpos, 1.0 / np.sqrt(c.head_dim))
        r = (a.astype(np.float64) @ t[BLK + "attn_output.weight"].T + (gn if c.norm_before_residual else g)).astype(np.float32)
        y = rms_norm(r, t[BLK + "ffn_norm.weight"], c.rms_eps).astype(np.float64)
        ff = silu((y @ t[BLK + "ffn_gate.weight"].T).astype(np.float32)) * (y @ t[BLK + "ffn_up.weight"].T)
        h = (ff.astype(np.float64) @ t[BLK + "ffn_down.weight"].T + r).astype(np.float32)
        if rows == "last":
            h = h[-1:]
        z = rms_norm(h, t["output_norm.weight"], c.rms_eps).astype(np.float64) @ t["output.weight"].T  # (k, V_d)
        logits = np.full((len(h), c.n_vocab), -np.inf, np.float32)
        logits[:, self.d2t] = z.astype(np.float32)
        return logits, h
