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

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from edgespec.heads.eagle3 import Eagle3Config


class TrainableHead(Protocol):
    """What ``Trainer`` needs of a head: GGUF-named parameters, d2t, a config (a dataclass, stored
    in checkpoints), its loss and acceptance count on one cached sequence, and its GGUF export."""

    config: Any
    d2t: torch.Tensor

    def parameters(self) -> Iterator[nn.Parameter]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> Any: ...
    def train(self, mode: bool = True) -> Any: ...
    def to(self, device: torch.device) -> Any: ...

    def sequence_loss(self, seq: Mapping[str, torch.Tensor], t2d: torch.Tensor, train: Any,
                      steps: int | None = None, rng: np.random.Generator | None = None) -> tuple[torch.Tensor, Any]: ...

    def acceptance_counts(self, right: Any, skip: int = 0) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """Chained acceptance of ``sequence_loss``'s ``right`` over every chain but the first ``skip``
        (chain c's first draft predicts t_{c+2}, for every kind)."""
        ...

    def export(self, path: Path, vocab_source: Path, weight_type: str = "f16",
               extra_kv: Mapping[str, str] | None = None) -> Path: ...


def _attr(name: str) -> str:
    return name.replace(".", "_")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def angle_dtype(device: torch.device) -> torch.dtype:
    """RoPE angles in float64 (positions × frequencies lose digits in float32), but float32 on mps,
    which has no float64."""
    return torch.float32 if device.type == "mps" else torch.float64


def rope_norm(x: torch.Tensor, pos: torch.Tensor, n_rot: int, base: float) -> torch.Tensor:
    """ggml rope mode 0: rotate adjacent pairs (x[2i], x[2i+1]). x: (N, heads, d); pos: (N,)."""
    f = angle_dtype(x.device)
    i = torch.arange(n_rot // 2, dtype=f, device=x.device)
    theta = (pos.to(f)[:, None] * base ** (-2.0 * i / n_rot)).to(x.dtype)  # (N, n_rot/2)
    cos, sin = torch.cos(theta)[:, None, :], torch.sin(theta)[:, None, :]
    x0, x1 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
    rot = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)  # (N, h, n_rot)
    return torch.cat([rot, x[..., n_rot:]], dim=-1)


def soft_labels(t2d: torch.Tensor, ids: torch.Tensor, lp: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The target's cached top-K next-token distribution restricted to the draft vocabulary and
    renormalised. ids, lp: (..., K) target ids and logprobs → (draft ids (..., K) with −1 outside,
    probabilities (..., K), kept mass (..., 1): 0 where none of the top-K is in the draft vocabulary)."""
    d = t2d[ids]
    p = torch.exp(lp) * (d >= 0)
    mass = p.sum(-1, keepdim=True)
    return d, p / mass.clamp_min(1e-12), mass


def soft_ce(z: torch.Tensor, d: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """−Σ p·log q over the top-K: z (..., V_d) draft logits, d/p from ``soft_labels`` → (...)."""
    return -(p * torch.log_softmax(z, dim=-1).gather(-1, d.clamp_min(0))).sum(-1)


def chain_counts(right: torch.Tensor, skip: int = 0) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """right (chains, depth) bool: draft k of a chain is right → (hits, counts) per position k, a hit
    at k being a chain whose drafts 1..k are all right; the first ``skip`` chains are not counted."""
    r = right.cpu().numpy().astype(bool)[skip:]
    return np.cumprod(r, axis=1).sum(0).astype(np.float64), np.full(r.shape[1], float(len(r)))


class GGUFHead(nn.Module):
    """Trainable GGUF-named parameters (``blk.0.attn_q.weight`` → attribute ``blk_0_attn_q_weight``),
    the head's d2t and the target's frozen token embeddings (a buffer, not exported).

    Args:
        names: the GGUF tensor names that become parameters.
        tensors: initial values (numpy), ``d2t`` included when V_d < V.
        n_vocab: V (d2t defaults to the identity).
        tok_embd: the target's token embeddings (V, H).
    """

    def __init__(self, names: list[str], tensors: Mapping[str, npt.NDArray[Any]], n_vocab: int,
                 tok_embd: npt.NDArray[np.float32]) -> None:
        super().__init__()
        self.names = names
        for n in self.names:
            setattr(self, _attr(n), nn.Parameter(torch.tensor(np.asarray(tensors[n], np.float32))))
        d2t = tensors.get("d2t", np.arange(n_vocab))
        self.register_buffer("d2t", torch.tensor(np.asarray(d2t, np.int64)), persistent=True)
        self.register_buffer("tok_embd", torch.tensor(np.asarray(tok_embd, np.float32)), persistent=False)

    def p(self, name: str) -> torch.Tensor:
        return getattr(self, _attr(name))

    def to_numpy(self) -> dict[str, npt.NDArray[Any]]:
        """GGUF tensor name → numpy array (float32; d2t int64 when V_d < V), for the GGUF writers."""
        out: dict[str, npt.NDArray[Any]] = {n: self.p(n).detach().cpu().numpy().copy() for n in self.names}
        if len(self.d2t) < len(self.tok_embd):
            out["d2t"] = self.d2t.cpu().numpy().copy()
        return out


class TorchEagle3(GGUFHead):
    """EAGLE-3 head (trainable) over a frozen target token embedding.

    Args:
        config: hyperparameters (``Eagle3Config``).
        tensors: initial GGUF-named tensors (numpy), ``d2t`` included when V_d < V.
        tok_embd: the target's token embeddings (V, H).
    """

    def __init__(self, config: Eagle3Config, tensors: Mapping[str, npt.NDArray[Any]],
                 tok_embd: npt.NDArray[np.float32]) -> None:
        config.check_tensors(tensors)
        super().__init__([n for n in config.shapes() if n != "d2t"], tensors, config.n_vocab, tok_embd)
        self.config = config

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
        pos = torch.arange(n, device=feats.device)
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
        pos = torch.arange(n, device=g.device)
        e = rms_norm(self.tok_embd[tokens], self.p("blk.0.attn_norm.weight"), c.rms_eps)
        q, k, v, gn = self._qkv(e, g, pos)
        group = c.n_head // c.n_head_kv
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("nhd,mhd->hnm", q, k) / float(np.sqrt(c.head_dim))
        s = s.masked_fill(~(pos[None, :] <= pos[:, None])[None], float("-inf"))
        a = torch.einsum("hnm,mhd->nhd", torch.softmax(s, -1), v).reshape(n, -1)
        z, h = self._rest(a, g, gn)
        logits = torch.full((n, c.n_vocab), float("-inf"), dtype=z.dtype, device=z.device)
        logits[:, self.d2t] = z
        return logits, h

    def sequence_loss(self, seq: Mapping[str, torch.Tensor], t2d: torch.Tensor, train: Any,
                      steps: int | None = None, rng: np.random.Generator | None = None
                      ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """TTT loss on one cached sequence: at step k and position P the label is the target's
        distribution at P+1 (``soft_labels``), step k weighted ``train.step_decay``^(k−1).

        Args:
            seq: the cache's tokens, feats, top_ids, top_lp as tensors.
            t2d: target id → draft id (−1 outside).
            train: the ``TrainConfig`` (ttt_steps, step_decay).
            steps: TTT depth (default ``train.ttt_steps``).
            rng: unused (every position trains).

        Returns:
            (weighted loss, per step a (N,) bool tensor: the head's argmax == the target's argmax,
            False where undefined).
        """
        steps = steps or train.ttt_steps
        tokens, n = seq["tokens"], len(seq["tokens"]) - 1
        outs = self.rollout(tokens[1:], seq["feats"][:n], steps)
        ids = seq["top_ids"][1:]  # row P: the target at P+1, predicting t_{P+2}
        d, p, mass = soft_labels(t2d, ids, seq["top_lp"][1:])
        pos = torch.arange(n, device=tokens.device)
        total = torch.zeros((), device=tokens.device)
        wsum = 0.0
        right = []
        for k, z in enumerate(outs, start=1):
            rows = (pos >= k - 1) & (mass[:, 0] > 0)
            ce = soft_ce(z, d, p)
            if rows.any():
                w = train.step_decay ** (k - 1)
                total = total + w * ce[rows].mean()
                wsum += w
            right.append((self.d2t[z.argmax(-1)] == ids[:, 0]) & (pos >= k - 1))
        return total / max(wsum, 1e-12), right

    @staticmethod
    def acceptance_counts(right: list[torch.Tensor], skip: int = 0
                          ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """Chained acceptance of ``sequence_loss``'s ``right``: (hits, counts) per position k over
        the chain origins o ≥ ``skip`` (step j of origin o is row o+j−1 of step j; origin o's first
        draft predicts t_{o+2})."""
        r = np.stack([x.cpu().numpy() for x in right])  # (steps, N)
        steps, n = r.shape
        hits, counts = np.zeros(steps), np.zeros(steps)
        for k in range(1, steps + 1):
            origins = np.arange(skip, n - k + 1)
            chain = np.ones(len(origins), bool)
            for j in range(1, k + 1):
                chain &= r[j - 1, origins + j - 1]
            hits[k - 1] += chain.sum()
            counts[k - 1] += len(origins)
        return hits, counts

    def export(self, path: Path, vocab_source: Path, weight_type: str = "f16",
               extra_kv: Mapping[str, str] | None = None) -> Path:
        """Write the head as a llama.cpp eagle3 GGUF (``write_eagle3_gguf``)."""
        from edgespec.heads.gguf_io import write_eagle3_gguf

        return write_eagle3_gguf(path, self.config, self.to_numpy(), vocab_source=vocab_source,
                                 weight_type=weight_type, extra_kv=extra_kv)
