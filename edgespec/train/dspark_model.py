"""DSpark's Markov and confidence heads in torch, trained on top of a frozen DFlash head.

The math is ``edgespec.heads.dspark``'s, i.e. llama.cpp's (vendored src/models/dflash.cpp
``build_dspark_markov_head`` with ``dflash.sample_from_anchor`` = false: the rows are DFlash's).
R = the Markov rank.
  z_r = the DFlash head's draft logits of block row r (V_d), h_r = its output-normed hidden (H);
  prev_1 = the anchor token, prev_r = the token of row r−1 (teacher-forced in training: t_{a+r−1});
  e_r = markov_w1[prev_r] (R);   logits_r = z_r + markov_w2 · e_r;
  conf_r = sigmoid(conf_proj · [h_r; e_r] + conf_b), the probability that argmax(logits_r) is the
  target's argmax (the prefix being right, as in teacher forcing).
Tensors (numpy shape = reversed GGUF ne): ``markov_w1.weight`` (V, R), ``markov_w2.weight`` (V_d, R),
``conf_proj.weight`` (1, H+R), ``conf_proj.bias`` (1,). Init: markov_w2 = 0 (the head starts as
its DFlash base), markov_w1 ~ N(0, 1/R), the confidence projection 0 (conf = 0.5).

Loss: DFlash's row-weighted soft cross-entropy of logits_r plus the confidence's binary
cross-entropy (mean over rows). Only these four tensors train; the DFlash base is frozen, so a
DSpark head and its base differ by the Markov term alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from edgespec.heads.dflash import DFlashConfig
from edgespec.heads.dspark import MARKOV_TENSORS
from edgespec.train.dflash_model import TorchDFlash
from edgespec.train.model import chain_counts


def dspark_config(base: DFlashConfig, markov_rank: int) -> DFlashConfig:
    """The DSpark head's config: its DFlash base's with a rank-R Markov head and a confidence head
    (bonus-anchor layout, ``sample_from_anchor`` = false)."""
    if base.markov_rank:
        raise ValueError("the base of a DSpark head must be a plain DFlash head (it has a Markov head already)")
    return replace(base, markov_rank=markov_rank, has_confidence=True, sample_from_anchor=False)


def init_dspark(config: DFlashConfig, seed: int) -> dict[str, npt.NDArray[np.float32]]:
    """Initial DSpark tensors of a ``dspark_config`` (see the module docstring)."""
    rng = np.random.default_rng(seed)
    s = config.shapes()
    w1 = rng.standard_normal(s["markov_w1.weight"], dtype=np.float32) / np.float32(np.sqrt(config.markov_rank))
    return {"markov_w1.weight": w1, "markov_w2.weight": np.zeros(s["markov_w2.weight"], np.float32),
            "conf_proj.weight": np.zeros(s["conf_proj.weight"], np.float32),
            "conf_proj.bias": np.zeros(s["conf_proj.bias"], np.float32)}


class TorchDSpark(nn.Module):
    """Markov + confidence heads over a frozen ``TorchDFlash`` base.

    Args:
        base: the trained DFlash head (its parameters are frozen here).
        tensors: initial DSpark tensors (``init_dspark``), GGUF-named.
        markov_rank: R.
    """

    def __init__(self, base: TorchDFlash, tensors: Mapping[str, npt.NDArray[Any]], markov_rank: int) -> None:
        super().__init__()
        self.config = dspark_config(base.config, markov_rank)
        for name in MARKOV_TENSORS:
            shape = self.config.shapes()[name]
            if tuple(tensors[name].shape) != shape:
                raise ValueError(f"tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}")
        self.base = base.requires_grad_(False)
        self.markov_w1 = nn.Parameter(torch.tensor(np.asarray(tensors["markov_w1.weight"], np.float32)))
        self.markov_w2 = nn.Parameter(torch.tensor(np.asarray(tensors["markov_w2.weight"], np.float32)))
        self.conf_w = nn.Parameter(torch.tensor(np.asarray(tensors["conf_proj.weight"], np.float32)))
        self.conf_b = nn.Parameter(torch.tensor(np.asarray(tensors["conf_proj.bias"], np.float32)))

    @property
    def d2t(self) -> torch.Tensor:
        return self.base.d2t

    def train(self, mode: bool = True) -> TorchDSpark:
        super().train(mode)
        self.base.eval()  # frozen (it has no dropout either: this only keeps it honest)
        return self

    def markov(self, z: torch.Tensor, h: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows' DSpark logits and confidence logits: z (..., V_d), h (..., H), prev (...) target ids →
        (logits (..., V_d), confidence before the sigmoid (...))."""
        e = self.markov_w1[prev]  # (..., R)
        logits = z + e @ self.markov_w2.T
        conf = (torch.cat([h, e], dim=-1) @ self.conf_w.T)[..., 0] + self.conf_b[0]
        return logits, conf

    def sequence_loss(self, seq: Mapping[str, torch.Tensor], t2d: torch.Tensor, train: Any,
                      steps: int | None = None, rng: np.random.Generator | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """DFlash's row-weighted CE of the Markov-corrected logits + the confidence's BCE, over the
        blocks of one sequence (anchors as ``TorchDFlash.sequence_loss``; ``steps`` unused).

        Returns:
            (loss, right (M, B−1) bool: row r's argmax == the target's argmax).
        """
        with torch.no_grad():
            a, block, z, h = self.base.anchor_blocks(seq, rng, train.anchors)
        b = self.config.block_size
        # (M, B−1): t_{a+r−1}, the anchor first
        prev = seq["tokens"][a[:, None] + torch.arange(b - 1, device=a.device)]
        logits, conf = self.markov(z[:, 1:], h[:, 1:], prev)
        labels = self.base.row_labels(seq, t2d, a)
        right = self.d2t[logits.argmax(-1)] == labels[3]
        ce = self.base.weighted_ce(logits, labels, train.step_decay)
        bce = nn.functional.binary_cross_entropy_with_logits(conf, right.to(conf.dtype)) if right.numel() else 0.0
        return ce + bce, right

    @staticmethod
    def acceptance_counts(right: torch.Tensor, skip: int = 0) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """(hits, counts) per row: blocks whose rows 1..r are all right, but the first ``skip`` blocks
        (held-out evaluation has every anchor a = 1, 2, …: block c's first row predicts t_{c+2})."""
        return chain_counts(right, skip)

    def to_numpy(self) -> dict[str, npt.NDArray[Any]]:
        """The base's tensors plus the DSpark ones, GGUF-named."""
        return self.base.to_numpy() | {
            "markov_w1.weight": self.markov_w1.detach().cpu().numpy().copy(),
            "markov_w2.weight": self.markov_w2.detach().cpu().numpy().copy(),
            "conf_proj.weight": self.conf_w.detach().cpu().numpy().copy(),
            "conf_proj.bias": self.conf_b.detach().cpu().numpy().copy()}

    def export(self, path: Path, vocab_source: Path, weight_type: str = "f16",
               extra_kv: Mapping[str, str] | None = None) -> Path:
        """Write the head as a llama.cpp dflash GGUF with DSpark's tensors (``write_dflash_gguf``)."""
        from edgespec.heads.dflash_gguf import write_dflash_gguf

        return write_dflash_gguf(path, self.config, self.to_numpy(), vocab_source=vocab_source,
                                 weight_type=weight_type, extra_kv=extra_kv)
