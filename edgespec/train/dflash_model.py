"""The DFlash head in torch: the function of the numpy DFlash oracle (tests/head_oracles.py; tested equal), with
a batched training forward over many blocks of one cached sequence.

Pairing (as drafting pairs it, ``edgespec.drafters.dflash``): on a cached sequence t_0..t_{L−1} with
target features f_0..f_{L−1}, a block anchored at a (1 ≤ a ≤ L−B) is [t_a, MASK×(B−1)] at positions
a..a+B−1; its rows attend to the context keys of positions p < a (the features the head's cache holds
when t_a is the pending token) and to all B keys of their own block (non-causal). Row r = 1..B−1
predicts t_{a+r}: its label is the cache row a+r−1 (the target's next-token distribution there).
The context K/V of all L positions are computed once per layer and shared by every block.

Loss: soft cross-entropy per row, row r weighted exp(−(r−1)/γ), γ = 4 (the DFlash paper's choice for
B = 8; later rows are harder and matter only if every earlier one is accepted).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from edgespec.heads.dflash import _LAYER, DFlashConfig
from edgespec.train.model import GGUFHead, angle_dtype, chain_counts, rms_norm, soft_ce, soft_labels

DFLASH_GAMMA = 4.0
DFLASH_DECAY = math.exp(-1.0 / DFLASH_GAMMA)  # TrainConfig.step_decay for DFlash rows


def rope_neox(x: torch.Tensor, pos: torch.Tensor, n_rot: int, base: float) -> torch.Tensor:
    """ggml rope NeoX mode: rotate (x[i], x[i + n_rot/2]). x: (..., heads, d); pos: x.shape[:-2]."""
    half = n_rot // 2
    f = angle_dtype(x.device)
    i = torch.arange(half, dtype=f, device=x.device)
    theta = (pos.to(f)[..., None] * base ** (-2.0 * i / n_rot)).to(x.dtype)  # (..., half)
    cos, sin = torch.cos(theta)[..., None, :], torch.sin(theta)[..., None, :]
    x0, x1 = x[..., :half], x[..., half:n_rot]
    return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos, x[..., n_rot:]], dim=-1)


class TorchDFlash(GGUFHead):
    """DFlash head (trainable) over a frozen target token embedding; the LM head is its own
    ``output.weight`` (V_d rows).

    Args:
        config: hyperparameters (``DFlashConfig``).
        tensors: initial GGUF-named tensors (numpy) with ``output.weight``, ``d2t`` when V_d < V.
        tok_embd: the target's token embeddings (V, H), which also embed the MASK token.
    """

    def __init__(self, config: DFlashConfig, tensors: Mapping[str, npt.NDArray[Any]],
                 tok_embd: npt.NDArray[np.float32]) -> None:
        config.check_tensors(tensors)
        if "output.weight" not in tensors or "token_embd.weight" in tensors:
            raise ValueError("TorchDFlash trains its own output.weight over the target's token embeddings")
        super().__init__([n for n in config.shapes() if n != "d2t"], tensors, config.n_vocab, tok_embd)
        self.config = config
        # fc reads features ⊙ feat_scale (see set_feature_scale); exported folded into fc.weight
        self.register_buffer("feat_scale", torch.ones(config.n_embd_enc), persistent=True)

    def set_feature_scale(self, scale: npt.NDArray[np.float32]) -> None:
        """Precondition fc: train it on features ⊙ ``scale`` (T·H,), exported as fc.weight ⊙ scale, the
        same function. Residual streams carry a few dimensions 10³–10⁵ times the others (SmolLM2,
        Gemma-3) in every row; llama.cpp's dflash applies fc to the raw features (no norm before it, unlike
        EAGLE-3's ``norm_before_fc``), so without this those dimensions dominate fc's gradients. Call
        before training: changing it afterwards changes the function."""
        self.feat_scale.copy_(torch.as_tensor(np.asarray(scale, np.float32)))

    def to_numpy(self) -> dict[str, npt.NDArray[Any]]:
        out = super().to_numpy()
        out["fc.weight"] = out["fc.weight"] * self.feat_scale.cpu().numpy()[None, :]
        return out

    def context_kv(self, feats: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer the context K (RoPE'd at positions 0..n−1) and V: feats (n, T·H) →
        [(K (n, n_head_kv, d), V (n, n_head_kv, d))]."""
        c = self.config
        g = rms_norm((feats * self.feat_scale) @ self.p("fc.weight").T, self.p("enc.output_norm.weight"),
                     c.rms_eps)  # (n, H)
        n, pos = len(g), torch.arange(len(g), device=g.device)
        out = []
        for i in range(c.n_layer):
            k = (g @ self.p(f"blk.{i}.attn_k.weight").T).view(n, c.n_head_kv, c.head_dim)
            k = rope_neox(rms_norm(k, self.p(f"blk.{i}.attn_k_norm.weight"), c.rms_eps), pos, c.n_rot, c.rope_base)
            out.append((k, (g @ self.p(f"blk.{i}.attn_v.weight").T).view(n, c.n_head_kv, c.head_dim)))
        return out

    def blocks(self, tokens: torch.Tensor, start: torch.Tensor, ctx: list[tuple[torch.Tensor, torch.Tensor]],
               visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder on M blocks at once.

        Args:
            tokens: (M, b) block tokens (target ids).
            start: (M,) position of each block's first row.
            ctx: ``context_kv`` of the n context positions.
            visible: (M, n) bool, the context keys each block attends to.

        Returns:
            (draft logits (M, b, V_d), output-normed hidden (M, b, H)).
        """
        c = self.config
        m, b = tokens.shape
        dev = tokens.device
        x = self.tok_embd[tokens]  # (M, b, H)
        if c.embedding_scale:
            x = x * c.embedding_scale
        pos = start[:, None] + torch.arange(b, device=dev)  # (M, b)
        group = c.n_head // c.n_head_kv
        scale = c.attention_scale or 1.0 / math.sqrt(c.head_dim)
        ctx_mask = torch.where(visible, 0.0, float("-inf"))[:, None, None, :]  # (M, 1, 1, n)
        blk_mask = torch.zeros(b, b, device=dev)
        if c.causal:
            blk_mask = torch.full((b, b), float("-inf"), device=dev).triu(1)
        for i, (kc, vc) in enumerate(ctx):
            w = {k: self.p(f"blk.{i}.{k}.weight") for k in _LAYER}
            u = rms_norm(x, w["attn_norm"], c.rms_eps)
            q = rms_norm((u @ w["attn_q"].T).view(m, b, c.n_head, c.head_dim), w["attn_q_norm"], c.rms_eps)
            k = rms_norm((u @ w["attn_k"].T).view(m, b, c.n_head_kv, c.head_dim), w["attn_k_norm"], c.rms_eps)
            v = (u @ w["attn_v"].T).view(m, b, c.n_head_kv, c.head_dim)
            q, k = rope_neox(q, pos, c.n_rot, c.rope_base), rope_neox(k, pos, c.n_rot, c.rope_base)
            kc, vc = kc.repeat_interleave(group, 1), vc.repeat_interleave(group, 1)  # (n, n_head, d)
            k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)  # (M, b, n_head, d)
            s_ctx = torch.einsum("mbhd,nhd->mhbn", q, kc) * scale + ctx_mask
            s_blk = torch.einsum("mbhd,mchd->mhbc", q, k) * scale + blk_mask
            a = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1)  # (M, n_head, b, n + b)
            n = kc.shape[0]
            o = torch.einsum("mhbn,nhd->mbhd", a[..., :n], vc) + torch.einsum("mhbc,mchd->mbhd", a[..., n:], v)
            o = o.reshape(m, b, c.n_head * c.head_dim) @ w["attn_output"].T
            if c.value_scale:
                o = o * c.value_scale
            r = x + o
            y = rms_norm(r, w["ffn_norm"], c.rms_eps)
            x = r + (nn.functional.silu(y @ w["ffn_gate"].T) * (y @ w["ffn_up"].T)) @ w["ffn_down"].T
        h = rms_norm(x, self.p("output_norm.weight"), c.rms_eps)
        return h @ self.p("output.weight").T, h

    def forward_block(self, feats: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The oracle's ``forward_block`` after injecting ``feats`` (n, T·H) into an empty cache: the block
        ``tokens`` (b,) at positions n..n+b−1 → (logits (b, V) with −inf outside d2t, hidden (b, H))."""
        n, dev = len(feats), feats.device
        z, h = self.blocks(tokens[None], torch.tensor([n], device=dev), self.context_kv(feats),
                           torch.ones(1, n, dtype=torch.bool, device=dev))
        logits = torch.full((len(tokens), self.config.n_vocab), float("-inf"), dtype=z.dtype, device=dev)
        logits[:, self.d2t] = z[0]
        return logits, h[0]

    def anchor_blocks(self, seq: Mapping[str, torch.Tensor], rng: np.random.Generator | None, n_anchors: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The blocks of one sequence: every anchor 1..L−B (``rng`` None) or ``n_anchors`` of them
        drawn without replacement → (anchors (M,), block tokens (M, B), draft logits (M, B, V_d),
        hidden (M, B, H))."""
        tokens, bsz = seq["tokens"], self.config.block_size
        last = len(tokens) - bsz  # the last anchor whose block rows all have a label
        a = np.arange(1, last + 1) if rng is None else np.sort(rng.choice(np.arange(1, last + 1),
                                                                          min(n_anchors, max(last, 0)), replace=False))
        dev = tokens.device
        a = torch.tensor(a, dtype=torch.int64, device=dev)
        block = torch.full((len(a), bsz), self.config.mask_token_id, dtype=torch.int64, device=dev)
        block[:, 0] = tokens[a]
        visible = torch.arange(len(tokens), device=dev)[None, :] < a[:, None]
        z, h = self.blocks(block, a, self.context_kv(seq["feats"]), visible)
        return a, block, z, h

    def sequence_loss(self, seq: Mapping[str, torch.Tensor], t2d: torch.Tensor, train: Any,
                      steps: int | None = None, rng: np.random.Generator | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Row-weighted soft CE over the blocks of one cached sequence.

        Args:
            seq: the cache's tokens, feats, top_ids, top_lp as tensors.
            t2d: target id → draft id (−1 outside).
            train: the ``TrainConfig`` (step_decay = row decay, anchors = blocks per sequence).
            steps: unused (the block fixes the depth: B−1 rows).
            rng: draws ``train.anchors`` anchors; None: every anchor (held-out evaluation).

        Returns:
            (loss, right (M, B−1) bool: row r's argmax == the target's argmax at a+r−1).
        """
        a, _, z, _ = self.anchor_blocks(seq, rng, train.anchors)
        labels = self.row_labels(seq, t2d, a)
        loss = self.weighted_ce(z[:, 1:], labels, train.step_decay)
        return loss, self.d2t[z[:, 1:].argmax(-1)] == labels[3]

    def row_labels(self, seq: Mapping[str, torch.Tensor], t2d: torch.Tensor, anchors: torch.Tensor
                   ) -> tuple[torch.Tensor, ...]:
        """``soft_labels`` of rows 1..B−1 of the blocks at ``anchors`` (M,): cache rows a..a+B−2 →
        (d, p, mass (M, B−1, 1), the target's argmax (M, B−1))."""
        idx = anchors[:, None] + torch.arange(self.config.block_size - 1, device=anchors.device)  # (M, B−1)
        ids = seq["top_ids"][idx]
        return (*soft_labels(t2d, ids, seq["top_lp"][idx]), ids[..., 0])

    @staticmethod
    def weighted_ce(z: torch.Tensor, labels: tuple[torch.Tensor, ...], decay: float) -> torch.Tensor:
        """Σ w_r·CE / Σ w_r over rows whose label has draft-vocabulary mass, w_r = decay^(r−1).
        z: (M, B−1, V_d)."""
        d, p, mass, _ = labels
        rows = torch.arange(z.shape[1], dtype=z.dtype, device=z.device)
        w = decay ** rows * (mass[..., 0] > 0)  # (M, B−1)
        if not w.numel():
            return z.sum() * 0.0  # no block fits the sequence: a zero loss still in the graph
        return (w * soft_ce(z, d, p)).sum() / w.sum().clamp_min(1e-12)

    @staticmethod
    def acceptance_counts(right: torch.Tensor, skip: int = 0) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """(hits, counts) per row: blocks whose rows 1..r are all right, but the first ``skip`` blocks
        (held-out evaluation has every anchor a = 1, 2, …: block c's first row predicts t_{c+2})."""
        return chain_counts(right, skip)

    def export(self, path: Path, vocab_source: Path, weight_type: str = "f16",
               extra_kv: Mapping[str, str] | None = None) -> Path:
        """Write the head as a llama.cpp dflash GGUF (``write_dflash_gguf``)."""
        from edgespec.heads.dflash_gguf import write_dflash_gguf

        return write_dflash_gguf(path, self.config, self.to_numpy(), vocab_source=vocab_source,
                                 weight_type=weight_type, extra_kv=extra_kv)
