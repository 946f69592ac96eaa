"""DFlash head: its config, tensor layout and block layout, after llama.cpp's dflash architecture
(src/models/dflash.cpp, 0.3.36); the heads run on libllama (heads/dflash_llama.py) and MLX
(heads/dflash_mlx.py), and a numpy forward of the function below is the tests' oracle
(tests/head_oracles.py).

Notation: H = head hidden size (llama.cpp requires the target's to be the same: the fused feature
width is T·H), T = number of target layers, B = block size, V = target vocabulary, V_d = draft
vocabulary. Weights are kept under their GGUF tensor names with numpy shape = reversed GGUF ne
(``blk.0.attn_q.weight`` is (n_head·head_dim, H)), as in ``edgespec.heads.eagle3``.

Context (one row per target position p, injected into the head's KV cache):
  g_p = RMSNorm(fc · f_p) · enc.output_norm, f_p = [input of target layer l for l in target_layers]
  and in every layer i: K_p = RoPE(RMSNorm_head(wk_i · g_p) · k_norm_i, p), V_p = wv_i · g_p
  (no attn_norm, no V norm: the same wk/wv as the block, applied to g directly).
Block (the draft pass, positions n..n+b−1 where n = context length, b ≤ B):
  x = E[[t_last, MASK, …, MASK]] (× embedding_scale if set); per layer:
  u = RMSNorm(x) · attn_norm; q, k, v = wq·u, wk·u, wv·u; per-head RMSNorm of q, k (q_norm, k_norm);
  RoPE (NeoX, rotate-half) at the block positions; attention of the b queries over
  [context K/V ; block K/V] with NO causal mask (unless ``causal``), scale = attention_scale or
  1/√head_dim; a = wo·attn (× value_scale if set); r = x + a; x = r + FFN_silu(RMSNorm(r)·ffn_norm).
  logits = output · (RMSNorm(x) · output_norm) for every block row, scattered to V by d2t (others
  −inf). llama.cpp computes all b rows and drafts greedily from rows 1..b−1 (b−1 ≤ B−1 tokens).

Supported: plain DFlash (Qwen3-style backbone) with optional own token_embd / output, d2t,
embedding/attention/value scales and a causal flag; DSpark's Markov and confidence heads (rank R,
bonus-anchor layout: ``edgespec.heads.dspark``). Not supported (refused by ``check_tensors``
and the GGUF reader): DFlash2 conv/selector, DSpark's sample_from_anchor layout, DSV4 hyper-connection
stages, attention sinks, post-norms, layer output scales, rope_freqs, quantization scale tensors,
shared K/V (no attn_v), sliding-window attention, M-RoPE sections and non-SiLU activations.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from edgespec.heads.eagle3 import config_property
from edgespec.heads.eagle3 import random_tensors as random_tensors  # DFlashConfig heads too (re-exported)

F32 = npt.NDArray[np.float32]
_LAYER = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
          "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class DFlashConfig:
    """Hyperparameters of a DFlash head (the dflash.* keys of its GGUF)."""

    n_embd: int  # H (== the target's hidden size)
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    target_layers: tuple[int, ...]  # llama.cpp extract ids: features = INPUT of each target layer
    n_vocab: int  # V: the target's vocabulary
    n_draft_vocab: int  # V_d (== V when the head has no d2t)
    mask_token_id: int
    block_size: int = 8  # B: the trained block, anchor included
    head_dim: int = 0  # 0: n_embd // n_head
    rms_eps: float = 1e-6
    rope_base: float = 1000000.0
    n_rot: int = 0  # 0: head_dim
    context_length: int = 4096
    causal: bool = False  # dflash.attention.causal: block-internal causal mask
    embedding_scale: float = 0.0  # 0: unset (llama.cpp's convention for these three)
    attention_scale: float = 0.0
    value_scale: float = 0.0
    markov_rank: int = 0  # R of DSpark's Markov head (markov_w1/w2); 0: plain DFlash
    has_confidence: bool = False  # DSpark's conf_proj (needs markov_rank > 0)
    sample_from_anchor: bool = False  # dflash.sample_from_anchor; only the bonus-anchor layout (False)

    def __post_init__(self) -> None:
        for name in ("rms_eps", "rope_base", "embedding_scale", "attention_scale", "value_scale"):
            object.__setattr__(self, name, float(np.float32(getattr(self, name))))  # GGUF float32
        object.__setattr__(self, "target_layers", tuple(int(x) for x in self.target_layers))
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.n_embd // self.n_head)
        if self.n_rot == 0:
            object.__setattr__(self, "n_rot", self.head_dim)
        if self.n_layer < 1 or not self.target_layers:
            raise ValueError(f"DFlash needs n_layer ≥ 1 and ≥ 1 target layer (got {self.n_layer}, {self.target_layers})")
        if self.n_head % self.n_head_kv or self.n_rot % 2 or self.n_rot > self.head_dim:
            raise ValueError(f"bad attention shape: n_head={self.n_head} n_head_kv={self.n_head_kv} "
                             f"head_dim={self.head_dim} n_rot={self.n_rot}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be ≥ 2 (anchor + at least one mask; got {self.block_size})")
        if not 0 < self.n_draft_vocab <= self.n_vocab:
            raise ValueError(f"n_draft_vocab must be in 1..n_vocab={self.n_vocab} (got {self.n_draft_vocab})")
        if not 0 <= self.mask_token_id < self.n_vocab:
            raise ValueError(f"mask_token_id must be in 0..{self.n_vocab - 1} (got {self.mask_token_id})")
        if self.markov_rank < 0 or (self.has_confidence and not self.markov_rank):
            raise ValueError(f"a confidence head needs a Markov head of rank ≥ 1 (got markov_rank={self.markov_rank})")
        if self.sample_from_anchor and self.markov_rank:
            raise ValueError("dflash.sample_from_anchor = true is not supported: edgespec's DSpark drafts rows "
                             "1..b−1 of the bonus-anchor layout only")

    @property
    def kind(self) -> str:
        """"DSpark" with a Markov head, else "DFlash"."""
        return "DSpark" if self.markov_rank else "DFlash"

    @property
    def n_embd_enc(self) -> int:
        """T·H: the width of a fused target-feature row."""
        return len(self.target_layers) * self.n_embd

    def shapes(self, own_embd: bool = False, own_output: bool = True) -> dict[str, tuple[int, ...]]:
        """GGUF tensor name → numpy shape of every tensor the head carries (d2t only if V_d < V;
        ``output.weight`` unless the LM head is the target's or tied to ``token_embd``)."""
        H, qd, kvd, hd = self.n_embd, self.n_head * self.head_dim, self.n_head_kv * self.head_dim, self.head_dim
        s: dict[str, tuple[int, ...]] = {"fc.weight": (H, self.n_embd_enc), "enc.output_norm.weight": (H,)}
        per = {"attn_norm": (H,), "attn_q": (qd, H), "attn_k": (kvd, H), "attn_v": (kvd, H),
               "attn_output": (H, qd), "attn_q_norm": (hd,), "attn_k_norm": (hd,), "ffn_norm": (H,),
               "ffn_gate": (self.n_ff, H), "ffn_up": (self.n_ff, H), "ffn_down": (H, self.n_ff)}
        for i in range(self.n_layer):
            s |= {f"blk.{i}.{k}.weight": per[k] for k in _LAYER}
        s["output_norm.weight"] = (H,)
        if own_output:
            s["output.weight"] = (self.n_draft_vocab, H)
        if self.n_draft_vocab < self.n_vocab:
            s["d2t"] = (self.n_draft_vocab,)
        if own_embd:
            s["token_embd.weight"] = (self.n_vocab, H)
        if self.markov_rank:
            s["markov_w1.weight"] = (self.n_vocab, self.markov_rank)
            s["markov_w2.weight"] = (self.n_draft_vocab, self.markov_rank)
        if self.has_confidence:
            s["conf_proj.weight"] = (1, H + self.markov_rank)
            s["conf_proj.bias"] = (1,)
        return s

    def check_tensors(self, tensors: Mapping[str, npt.NDArray]) -> None:
        """ValueError naming the first missing, unsupported or misshapen tensor."""
        want = self.shapes(own_embd="token_embd.weight" in tensors, own_output="output.weight" in tensors)
        extra = sorted(set(tensors) - set(want))
        if extra:
            raise ValueError(f"unsupported DFlash tensors (not in this {self.kind} config): {', '.join(extra)}")
        for name, shape in want.items():
            if name not in tensors:
                raise ValueError(f"DFlash head lacks tensor {name} {shape}")
            if tuple(tensors[name].shape) != shape:
                raise ValueError(f"tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}")
        if "d2t" in tensors:
            if "output.weight" not in tensors:
                raise ValueError("a DFlash head with d2t needs its own output.weight (V_d rows)")
            d2t = np.asarray(tensors["d2t"])
            if d2t.min() < 0 or d2t.max() >= self.n_vocab or len(np.unique(d2t)) != len(d2t):
                raise ValueError(f"d2t must hold distinct target ids in 0..{self.n_vocab - 1}")


class DFlashBlocks(ABC):
    """What every in-process DFlash head derives from its ``config`` and ``forward_block``: the block
    layout, its validation and greedy drafting (heads.dflash_mlx.MlxDFlashHead, the tests' numpy oracle)."""

    config: DFlashConfig

    block_size = config_property("block_size", "B: the trained block, anchor included.")
    mask_token_id = config_property("mask_token_id", "The MASK token filling a block after its anchor.")

    def block_tokens(self, anchor: int, n: int | None = None) -> list[int]:
        """[anchor, MASK×(n−1)], n = block_size by default (common/speculative.cpp's noise block)."""
        n = self.config.block_size if n is None else n
        return [int(anchor)] + [self.config.mask_token_id] * (n - 1)

    def check_block(self, tokens: Sequence[int]) -> npt.NDArray[np.int64]:
        """The block's ids as int64; ValueError unless it holds 1..block_size target ids."""
        c = self.config
        if not 1 <= len(tokens) <= c.block_size:
            raise ValueError(f"a block holds 1..{c.block_size} tokens (got {len(tokens)})")
        ids = np.asarray(tokens, np.int64)
        if ids.min() < 0 or ids.max() >= c.n_vocab:
            raise ValueError(f"block tokens must be target ids in 0..{c.n_vocab - 1}")
        return ids

    @abstractmethod
    def forward_block(self, tokens: Sequence[int]) -> tuple[F32, F32]:
        """(logits (b, V) with −inf outside the draft vocabulary, the normed hidden (b, H))."""

    def block_logits(self, tokens: Sequence[int]) -> F32:
        """Only the logits of ``forward_block`` (the interface LlamaDFlashHead shares)."""
        return self.forward_block(tokens)[0]

    def draft(self, anchor: int, n_draft: int | None = None) -> list[int]:
        """Greedy drafts after ``anchor`` (the last accepted token, at position n_past): argmax of
        block rows 1..n_draft, n_draft ≤ block_size − 1 (default: all of them)."""
        n_draft = self.config.block_size - 1 if n_draft is None else n_draft
        if not 1 <= n_draft < self.config.block_size:
            raise ValueError(f"n_draft must be in 1..{self.config.block_size - 1} (got {n_draft})")
        return [int(i) for i in self.block_logits(self.block_tokens(anchor, n_draft + 1))[1:].argmax(axis=1)]
