"""Medusa heads in torch (Cai et al., ICML 2024, arXiv 2401.10774), trained by self-distillation:
the function of ``edgespec.heads.medusa.MedusaHead`` (tested equal), its loss and acceptance count on
one cached sequence, and its export to the medusa GGUF layout that ``--drafter`` runs
(``drafters.medusa``).

Head k (0-based) reads the target's final-norm hidden state h_t at position t (libllama's graph
tensor ``result_norm``, what the target's LM head reads) and predicts token t+2+k:
``x ← x + SiLU(W x + b)`` per residual block, then the target's own LM head, frozen and shared by every
head (Medusa-1 with ``shared_lm_head``: the GGUF holds only K·L·(H² + H) weights). The blocks start at
zero (upstream ``ResBlock`` zeroes its weight; its bias is zeroed here too), so an untrained head k is the
target's LM head on h_t: it predicts t+1 where t+2+k is wanted, the baseline training must beat.

Data: the cache's ``feats`` are the hidden states themselves (``HiddenRows`` makes a
``LlamaHiddenBackend`` look like a feature backend to ``features.build_cache``: one evaluation of each
sequence with every row an output, the same callback the runtime captures through). Labels: the
target's own top-32 distribution at position t+1+k (the cache's ``top_ids``/``top_lp`` row t+1+k, its
prediction of token t+2+k), i.e. Medusa-2's self-distillation loss (the paper's §2.3.2: KL to the
original model's distribution instead of the data's tokens), renormalised over the top 32. Head k is
weighted λ_k = 0.8^k as in Medusa-1 (§2.2.1: "λ_k is set as the k-th power of a constant like 0.8").
A training sequence contributes ``ROWS`` random positions (every head's logits are V wide: all 256
positions × K heads would be K × 256 × V floats per sequence); evaluation reads every position.

Acceptance (greedy, as speculative decoding pays for it): head k is right at origin t when its argmax
is the target's argmax at t+1+k; position k of a chain counts origins whose heads 0..k are all right
(the other kinds' convention: origin t's first draft predicts t_{t+2}).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from edgespec.heads.medusa import MedusaConfig, res_bias, res_weight, write_medusa_gguf
from edgespec.train.model import soft_ce, soft_labels
from edgespec.train.trainer import sequence_tensors

MEDUSA_DECAY = 0.8  # λ_k = 0.8^k (Medusa-1, §2.2.1)
ROWS = 64  # positions per training sequence (sampled); evaluation: every position
HIDDEN_TENSOR = "result_norm"  # backends.llama_hidden.HIDDEN_TENSOR (not imported: it loads libllama)


class HiddenRows:
    """A ``LlamaHiddenBackend`` (``open_backend(..., hidden=True)``) as ``features.build_cache`` reads a
    feature backend: ``features(start, end)`` are its final-norm rows h_p, ``feature_layers`` names the
    tensor. Everything else is the backend's."""

    feature_layers = (HIDDEN_TENSOR,)

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def features(self, start: int, end: int) -> npt.NDArray[np.float32]:
        rows = [self._backend.hidden(p) for p in range(start, end)]
        missing = [p for p, r in zip(range(start, end), rows) if r is None]
        if missing:
            raise RuntimeError(f"the target kept no hidden row for positions {missing[:4]}… (evaluate with rows='all')")
        return np.stack(rows)

    def close(self) -> None:
        self._backend.close()


def zero_tensors(config: MedusaConfig) -> dict[str, npt.NDArray[np.float32]]:
    """Untrained heads: every residual block zero (each head is then the target's LM head on h)."""
    return {name: np.zeros(shape, np.float32) for name, shape in config.shapes().items()}


class TorchMedusa(nn.Module):
    """K Medusa heads of L residual blocks on the target's frozen LM head (``shared_lm_head``).

    Args:
        config: the heads' shape (``shared_lm_head`` must be True).
        lm_head: the target's output matrix (V, H) (its token embeddings when tied), a frozen buffer
            (not exported, not checkpointed).
        tensors: initial GGUF-named tensors (default ``zero_tensors``).
    """

    def __init__(self, config: MedusaConfig, lm_head: npt.NDArray[Any],
                 tensors: Mapping[str, npt.NDArray[Any]] | None = None) -> None:
        super().__init__()
        if not config.shared_lm_head or config.n_layers < 1:
            raise ValueError(f"trained Medusa heads share the target's LM head and have ≥ 1 block (got "
                             f"shared_lm_head={config.shared_lm_head}, layers={config.n_layers})")
        if tuple(lm_head.shape) != (config.n_vocab, config.n_embd):
            raise ValueError(f"the LM head is {tuple(lm_head.shape)}, the heads need ({config.n_vocab}, {config.n_embd})")
        tensors = zero_tensors(config) if tensors is None else tensors
        config.check_tensors(tensors)
        self.config = config
        self.names = list(config.shapes())
        for n in self.names:
            setattr(self, n.replace(".", "_"), nn.Parameter(torch.tensor(np.asarray(tensors[n], np.float32))))
        self.register_buffer("lm_head", torch.tensor(np.asarray(lm_head, np.float32)), persistent=False)
        self.register_buffer("d2t", torch.arange(config.n_vocab), persistent=False)  # the whole vocabulary

    def p(self, name: str) -> torch.Tensor:
        return getattr(self, name.replace(".", "_"))

    def state(self, h: torch.Tensor, k: int) -> torch.Tensor:
        """Head k's state after its residual blocks: h (N, H) → (N, H)."""
        x = h
        for j in range(self.config.n_layers):
            x = x + nn.functional.silu(x @ self.p(res_weight(k, j)).T + self.p(res_bias(k, j)))
        return x

    def logits(self, h: torch.Tensor, k: int) -> torch.Tensor:
        """Head k's logits over the vocabulary (N, V): row i predicts the token k + 2 after h[i]'s."""
        return self.state(h, k) @ self.lm_head.T

    def sequence_loss(self, seq: Mapping[str, torch.Tensor], t2d: torch.Tensor, train: Any,
                      steps: int | None = None, rng: np.random.Generator | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Self-distillation loss on one cached sequence (see the module doc).

        Args:
            seq: the cache's tokens, feats (the hidden states h_t), top_ids, top_lp as tensors.
            t2d: target id → draft id (the identity here: the heads draft the whole vocabulary).
            train: the ``TrainConfig`` (``step_decay``: λ).
            steps: unused (every head trains).
            rng: with it, ``ROWS`` random positions; without, every position.

        Returns:
            (weighted loss, right (N, K) bool: row i of the positions used, head k's argmax == the
            target's argmax at t_i+1+k; False where t_i+1+k is past the sequence's last row).
        """
        n = len(seq["tokens"]) - 1  # origins 0..n−1: the last row's label would be past the sequence
        pos = torch.arange(max(n, 0), device=seq["feats"].device)
        if rng is not None and n > ROWS:
            pos = pos[torch.as_tensor(np.sort(rng.choice(n, ROWS, replace=False)), device=pos.device)]
        h = seq["feats"][pos]
        total = torch.zeros((), device=h.device)
        wsum, right = 0.0, []
        for k in range(self.config.n_heads):
            ok = pos + 1 + k <= n
            at = (pos + 1 + k).clamp_max(n)  # the target's row t+1+k: its distribution over token t+2+k
            ids = seq["top_ids"][at]
            d, p, mass = soft_labels(t2d, ids, seq["top_lp"][at])
            z = self.logits(h, k)
            rows = ok & (mass[:, 0] > 0)
            if rows.any():
                w = train.step_decay ** k
                total = total + w * soft_ce(z[rows], d[rows], p[rows]).mean()
                wsum += w
            right.append((z.argmax(-1) == ids[:, 0]) & ok)
        return total / max(wsum, 1e-12), torch.stack(right, 1)

    @staticmethod
    def acceptance_counts(right: torch.Tensor, skip: int = 0) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """Chained acceptance of ``sequence_loss``'s ``right`` (every position): (hits, counts) per chain
        position k over the origins t ≥ ``skip`` whose heads 0..k all have a label."""
        r = np.cumprod(right.cpu().numpy().astype(bool), axis=1)
        n, heads = r.shape
        hits, counts = np.zeros(heads), np.zeros(heads)
        for k in range(heads):
            origins = np.arange(skip, n - k)
            hits[k], counts[k] = r[origins, k].sum(), len(origins)
        return hits, counts

    def to_numpy(self) -> dict[str, npt.NDArray[np.float32]]:
        return {n: self.p(n).detach().cpu().numpy().copy() for n in self.names}

    def export(self, path: Path, vocab_source: Path, weight_type: str = "f16",
               extra_kv: Mapping[str, str] | None = None) -> Path:
        """Write the heads as a medusa GGUF (``heads.medusa.write_medusa_gguf``; shared LM head)."""
        return write_medusa_gguf(path, self.config, self.to_numpy(), vocab_source=vocab_source,
                                 weight_type=weight_type, extra_kv=extra_kv)


@torch.no_grad()
def head_top1(model: TorchMedusa, files: Iterable[Path], t2d: torch.Tensor, train: Any,
              device: torch.device | str = "cpu") -> list[float]:
    """Per head k, unchained: the share of origins after each file's prompt (as ``Trainer.evaluate``
    counts them) whose head-k argmax is the target's argmax at t+1+k (what a tree's depth k+1 needs
    of its first candidate)."""
    model.eval()
    hits = counts = None
    for f in files:
        seq = sequence_tensors(f, device)
        _, right = model.sequence_loss(seq, t2d, train)
        r = right.cpu().numpy()
        skip, n = max(0, int(seq["n_prompt"]) - 2), len(r)
        h = np.array([r[skip:n - k, k].sum() for k in range(r.shape[1])], np.float64)
        c = np.array([max(0, n - k - skip) for k in range(r.shape[1])], np.float64)
        hits, counts = (h, c) if hits is None else (hits + h, counts + c)
    return [] if hits is None else (hits / np.maximum(counts, 1)).tolist()
