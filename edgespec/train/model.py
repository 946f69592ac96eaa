"""The EAGLE-3 head in torch: the function of ``edgespec.heads.eagle3.Eagle3Head`` (tested equal),
with training-time test (TTT).

Parameters carry the GGUF tensor names (``blk.0.attn_q.weight`` → attribute ``blk_0_attn_q_weight``)
and numpy/GGUF shapes, so ``to_numpy()`` feeds ``write_eagle3_gguf`` with no renaming. The target's
token embeddings are a frozen buffer (shared, not exported).

TTT (EAGLE-3): on a sequence t_0..t_{N} with target features f_0..f_{N-1}, step 1 runs the decoder
on (t_{P+1}, fc(f_P)) at every position P, exactly as drafting's first token does. Step k > 1 runs
it on (t_{P+1}, h^{(k-1)}_{P-1}): the head's own previous output one position back, as when it
drafts on from its own hidden state. Its query at P attends to step-1 keys at positions ≤ P−k+1
(the context the head's cache holds from real features) and to the keys its own chain wrote at
P−k+2..P in steps 2..k — the cache the head sees at inference when drafting the k-th token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from edgespec.heads.eagle3 import Eagle3Config


def _attr(name: str) -> str:
    return name.replace(".", "_")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_norm(x: torch.Tensor, pos: torch.Tensor, n_rot: int, base: float) -> torch.Tensor:
    """ggml rope mode 0: rotate adjacent pairs (x[2i], x[2i+1]). x: (N, heads, d); pos: (N,)."""
    i = torch.arange(n_rot // 2, dtype=torch.float64)
    theta = (pos.to(torch.float64)[:, None] * base ** (-2.0 * i / n_rot)).to(x.dtype)  # (N, n_rot/2)
    cos, sin = torch.cos(theta)[:, None, :], torch.sin(theta)[:, None, :]
    x0, x1 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
    rot = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)  # (N, h, n_rot)
    return torch.cat([rot, x[..., n_rot:]], dim=-1)


class TorchEagle3(nn.Module):
    """EAGLE-3 head (trainable) over a frozen target token embedding.

    Args:
        config: hyperparameters (``Eagle3Config``).
        tensors: initial GGUF-named tensors (numpy), ``d2t`` included when V_d < V.
        tok_embd: the target's token embeddings (V, H).
    """

    def __init__(self, config: Eagle3Config, tensors: Mapping[str, npt.NDArray[Any]],
                 tok_embd: npt.NDArray[np.float32]) -> None:
        super().__init__()
        config.check_tensors(tensors)
        self.config = config
        self.names = [n for n in config.shapes() if n != "d2t"]
        for n in self.names:
            setattr(self, _attr(n), nn.Parameter(torch.tensor(np.asarray(tensors[n], np.float32))))
        d2t = tensors.get("d2t", np.arange(config.n_vocab))
        self.register_buffer("d2t", torch.tensor(np.asarray(d2t, np.int64)), persistent=True)
        self.register_buffer("tok_embd", torch.tensor(np.asarray(tok_embd, np.float32)), persistent=False)

    def p(self, name: str) -> torch.Tensor:
        return getattr(self, _attr(name))

    def to_numpy(self) -> dict[str, npt.NDArray[Any]]:
        """GGUF tensor name → numpy array (float32; d2t int64), for ``write_eagle3_gguf``."""
        out: dict[str, npt.NDArray[Any]] = {n: self.p(n).detach().cpu().numpy().copy() for n in self.names}
        if self.config.n_draft_vocab < self.config.n_vocab:
            out["d2t"] = self.d2t.cpu().numpy().copy()
        return out

    def encode(self, feats: torch.Tensor) -> torch.Tensor:
        """(N, 3·H_t) → g (N, H)."""
        c = self.config
        if c.norm_before_fc:
            feats = rms_norm(feats, self.p("enc.output_norm.weight"), c.rms_eps)
        return feats @ self.p("fc.weight").T

    def _qkv(self, e: torch.Tensor, g: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c, n = self.config, len(e)
        gn = rms_norm(g, self.p("blk.0.attn_norm_2.weight"), c.rms_eps)
        x = torch.cat([e, gn], dim=-1)  # (N, 2H)
        q = (x @ self.p("blk.0.attn_q.weight").T).view(n, c.n_head, c.head_dim)
        k = (x @ self.p("blk.0.attn_k.weight").T).view(n, c.n_head_kv, c.head_dim)
        v = (x @ self.p("blk.0.attn_v.weight").T).view(n, c.n_head_kv, c.head_dim)
        return rope_norm(q, pos, c.n_rot, c.rope_base), rope_norm(k, pos, c.n_rot, c.rope_base), v, gn

    def _rest(self, a: torch.Tensor, g: torch.Tensor, gn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """attention output (N, n_head·d) → (draft logits (N, V_d), pre-norm h (N, H))."""
        c = self.config
        r = a @ self.p("blk.0.attn_output.weight").T + (gn if c.norm_before_residual else g)
        y = rms_norm(r, self.p("blk.0.ffn_norm.weight"), c.rms_eps)
        ff = nn.functional.silu(y @ self.p("blk.0.ffn_gate.weight").T) * (y @ self.p("blk.0.ffn_up.weight").T)
        h = ff @ self.p("blk.0.ffn_down.weight").T + r
        z = rms_norm(h, self.p("output_norm.weight"), c.rms_eps) @ self.p("output.weight").T
        return z, h

    def rollout(self, tokens_next: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test over one sequence.

        Args:
            tokens_next: (N,) t_{P+1} for P = 0..N-1 (target ids).
            feats: (N, 3·H_t) target features f_P.
            steps: TTT depth k_max ≥ 1.

        Returns:
            ``steps`` tensors (N, V_d) of draft-vocabulary logits; step k's row P predicts
            t_{P+2} and is meaningful for P ≥ k−1.
        """
        c = self.config
        n = len(tokens_next)
        pos = torch.arange(n)
        e = rms_norm(self.tok_embd[tokens_next], self.p("blk.0.attn_norm.weight"), c.rms_eps)
        g = self.encode(feats)
        group = c.n_head // c.n_head_kv
        scale = 1.0 / float(np.sqrt(c.head_dim))
        k1 = v1 = None
        h = g  # replaced by each step's output before step 2 reads it
        chain: list[tuple[torch.Tensor, torch.Tensor]] = []  # keys/values of steps ≥ 2, unshifted
        out = []
        for step in range(1, steps + 1):
            if step > 1:
                g = torch.cat([torch.zeros_like(h[:1]), h[:-1]])  # h^{(k-1)}_{P-1}
            q, k, v, gn = self._qkv(e, g, pos)
            if step == 1:
                k1, v1 = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # (N, n_head, d)
            else:
                chain.append((k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
            s = torch.einsum("nhd,mhd->hnm", q, k1) * scale  # (n_head, N, N)
            allowed = pos[None, :] <= (pos[:, None] - (step - 1))  # key m ≤ P − k + 1
            s = s.masked_fill(~allowed[None], float("-inf"))
            diag_s, diag_v = [], []
            for j, (kj, vj) in enumerate(chain, start=2):  # step j's key at P − (k − j)
                shift = step - j
                kj_s = torch.cat([torch.zeros_like(kj[:shift]), kj[:n - shift]]) if shift else kj
                vj_s = torch.cat([torch.zeros_like(vj[:shift]), vj[:n - shift]]) if shift else vj
                diag_s.append((q * kj_s).sum(-1).T[..., None] * scale)  # (n_head, N, 1)
                diag_v.append(vj_s)
            if diag_s:
                s = torch.cat([s, *diag_s], dim=-1)
            w = torch.softmax(s, dim=-1)
            a = torch.einsum("hnm,mhd->nhd", w[..., :n], v1)
            for idx, vj_s in enumerate(diag_v):
                a = a + w[..., n + idx].T[..., None] * vj_s
            z, h = self._rest(a.reshape(n, c.n_head * c.head_dim), g, gn)
            out.append(z)
        return out

    def decode_plain(self, tokens: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 1 only, as ``Eagle3Head.decode`` from an empty cache: (logits over V with −inf outside
        the draft vocabulary (N, V), pre-norm h (N, H))."""
        c, n = self.config, len(tokens)
        pos = torch.arange(n)
        e = rms_norm(self.tok_embd[tokens], self.p("blk.0.attn_norm.weight"), c.rms_eps)
        q, k, v, gn = self._qkv(e, g, pos)
        group = c.n_head // c.n_head_kv
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("nhd,mhd->hnm", q, k) / float(np.sqrt(c.head_dim))
        s = s.masked_fill(~(pos[None, :] <= pos[:, None])[None], float("-inf"))
        a = torch.einsum("hnm,mhd->nhd", torch.softmax(s, -1), v).reshape(n, -1)
        z, h = self._rest(a, g, gn)
        logits = torch.full((n, c.n_vocab), float("-inf"), dtype=z.dtype)
        logits[:, self.d2t] = z
        return logits, h
