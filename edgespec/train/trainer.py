"""Training a head (EAGLE-3, DFlash, DSpark) on a feature cache: AdamW, a time budget, held-out
acceptance, exact checkpoint/resume, GGUF export. The loss and the acceptance count are the head's
own (``model.sequence_loss`` / ``model.acceptance_counts``; see ``edgespec.train.model`` and
``edgespec.train.dflash_model``).

Loss: soft-label cross-entropy −Σ p·log q over the draft vocabulary (KL(p‖q) up to p's entropy),
p = the target's distribution at the predicted position (its top-K kept in the cache, restricted to
the draft vocabulary and renormalised), draft position k weighted ``step_decay``^(k−1): 0.8 for
EAGLE-3's TTT steps as in its reference training, exp(−1/γ) with γ = 4 for DFlash's block rows.

Acceptance (greedy, the quantity speculative decoding pays for): a draft at position k is right
when the head's argmax equals the target's argmax; "position k" counts chains (EAGLE-3: from every
origin; DFlash: every block) whose drafts 1..k are all right.

Determinism: the sample order is a function of (seed, epoch) only, DFlash's anchors of (seed, sample
index), and the model has no dropout, so a
run stopped after any step and resumed from its checkpoint continues exactly as one that never
stopped (tested).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from edgespec.heads.dflash import DFlashConfig
from edgespec.heads.eagle3 import Eagle3Config, random_tensors
from edgespec.train.data import target_to_draft
from edgespec.train.features import FeatureCache
from edgespec.train.model import TrainableHead


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings (stored in checkpoints and in the exported GGUF's metadata)."""

    ttt_steps: int = 4  # TTT depth: the head is unrolled on its own outputs this many steps
    lr: float = 5e-4
    weight_decay: float = 0.01
    batch: int = 4  # sequences per optimizer step
    grad_clip: float = 1.0
    step_decay: float = 0.8  # weight of draft position k (TTT step, DFlash block row): decay^(k-1)
    anchors: int = 16  # DFlash/DSpark: blocks (anchor positions) sampled per sequence per step
    seed: int = 0
    eval_every: int = 50
    bf16: bool = True  # bfloat16 autocast for the forward/backward (weights and optimizer stay float32)
    decay_steps: int = 0  # > 0: the learning rate falls linearly from lr to 0 over this many steps


def head_config(n_embd: int, n_head: int, n_head_kv: int, n_ff: int, layers: Sequence[int], n_vocab: int,
                n_draft_vocab: int, rms_eps: float = 1e-5, rope_base: float = 10000.0,
                head_dim: int = 0, norm_before_fc: bool = True) -> Eagle3Config:
    """The head's shape: one decoder layer of the target's own width and attention shape.
    ``norm_before_fc`` RMS-normalises the fused features before fc (EAGLE-3.1; llama.cpp's
    ``eagle3.norm_before_fc``): residual streams carry outlier dimensions of 10⁴–10⁵ (SmolLM2, Gemma-3),
    which raw fc inputs would hand straight to the optimiser."""
    return Eagle3Config(n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff, n_embd_tgt=n_embd,
                        target_layers=tuple(layers), n_vocab=n_vocab, n_draft_vocab=n_draft_vocab,
                        head_dim=head_dim, rms_eps=rms_eps, rope_base=rope_base, norm_before_fc=norm_before_fc)


def init_tensors(config: Eagle3Config | DFlashConfig, d2t: npt.NDArray[np.int64], seed: int,
                 lm_head: npt.NDArray[np.float32] | None = None,
                 output_norm: npt.NDArray[np.float32] | None = None) -> dict[str, npt.NDArray[Any]]:
    """Initial weights: ``random_tensors`` (N(0, 1/fan_in), norms 1), except that the LM head and the
    final norm may start as the target's own (rows d2t of ``lm_head``, the target's output matrix or
    its tied token_embd): the head then only has to produce a hidden state the target's unembedding
    reads well, instead of learning V_d·H output weights from scratch (the norm: see
    ``MAX_BORROWED_NORM``).
    """
    t = random_tensors(config, seed=seed, d2t=d2t)
    if lm_head is not None:
        t["output.weight"] = np.asarray(lm_head[d2t], np.float32)
    if output_norm is not None and float(np.abs(output_norm).mean()) <= MAX_BORROWED_NORM:
        t["output_norm.weight"] = np.asarray(output_norm, np.float32)
    return t


# A target's final norm is borrowed only when its weights are moderate (SmolLM2: mean |w| 1.8).
# Gemma-3's (mean 26, max 301) is tuned to its own residual outliers: on a fresh head's hidden state
# it makes logits of scale 10², the loss starts near 100 and AdamW needs thousands of steps to
# shrink it, so the head's norm starts at 1 there.
MAX_BORROWED_NORM = 4.0


class Trainer:
    """Trains ``model`` on the files of ``cache`` (``train_files``), evaluating on ``val_files``.

    Args:
        model: the head (its d2t fixes the draft vocabulary).
        train_files, val_files: ``seq_*.npz`` paths (see ``features``).
        config: optimisation settings.
    """

    def __init__(self, model: TrainableHead, train_files: Sequence[Path], val_files: Sequence[Path],
                 config: TrainConfig) -> None:
        if not train_files:
            raise ValueError("no training sequences in the feature cache")
        self.model, self.config = model, config
        self.train_files, self.val_files = list(train_files), list(val_files)
        self.t2d = torch.tensor(target_to_draft(model.d2t.numpy(), model.config.n_vocab))
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr,
                                     weight_decay=config.weight_decay)
        self.step = 0
        self.elapsed = 0.0  # training seconds over all runs (resumes included)
        self.history: list[dict[str, float]] = []

    # -- data --------------------------------------------------------------------------------------

    def _sample(self, i: int) -> Path:
        """The i-th training sample: epoch i // n, in that epoch's seeded permutation."""
        n = len(self.train_files)
        order = np.random.default_rng([self.config.seed, i // n]).permutation(n)
        return self.train_files[order[i % n]]

    @staticmethod
    def _tensors(path: Path) -> dict[str, torch.Tensor]:
        z = FeatureCache.load_file(path)
        return {"tokens": torch.tensor(z["tokens"].astype(np.int64)),
                "feats": torch.tensor(z["feats"]),
                "top_ids": torch.tensor(z["top_ids"].astype(np.int64)),
                "top_lp": torch.tensor(z["top_lp"].astype(np.float32)),
                "n_prompt": torch.tensor(int(z["n_prompt"]))}

    # -- loss and acceptance (the head's own objective) ---------------------------------------------

    def sequence_loss(self, seq: dict[str, torch.Tensor], steps: int | None = None,
                      rng: np.random.Generator | None = None) -> tuple[torch.Tensor, Any]:
        """The head's loss on one sequence and its per-draft correctness (``model.sequence_loss``)."""
        return self.model.sequence_loss(seq, self.t2d, self.config, steps, rng)

    @torch.no_grad()
    def evaluate(self, files: Sequence[Path] | None = None, steps: int | None = None,
                 generated_only: bool = True) -> dict[str, Any]:
        """Held-out loss, chained top-1 acceptance per draft position (1..depth) over chains whose first
        draft predicts a generated token (after the file's ``n_prompt`` prompt tokens), and τ = 1 + Σ
        acceptance. ``generated_only=False`` counts chains starting in the prompt too."""
        files = self.val_files if files is None else files
        hits: npt.NDArray[np.float64] | None = None
        counts = np.zeros(0)
        losses = []
        for f in files:
            seq = self._tensors(f)
            loss, right = self.sequence_loss(seq, steps)
            # only drafts of generated tokens count: a prompt (chat template, default system prompt) is
            # easy to predict from its own features but is never drafted at run time
            skip = max(0, int(seq["n_prompt"]) - 2) if generated_only else 0
            h, c = self.model.acceptance_counts(right, skip=skip)
            if c.size and c[0] > 0:
                losses.append(float(loss.detach()))
            hits, counts = (h, c) if hits is None else (hits + h, counts + c)
        acc = (hits / np.maximum(counts, 1)).tolist() if hits is not None else []
        # τ-estimate: expected tokens per target pass with greedy verification of `depth` drafts
        return {"loss": float(np.mean(losses)) if losses else float("nan"), "acceptance": acc, "tau": 1.0 + sum(acc)}

    # -- optimisation ------------------------------------------------------------------------------

    def train_step(self) -> float:
        """One AdamW step over ``batch`` sequences; returns the mean loss."""
        self.model.train()
        if self.config.decay_steps:
            for group in self.opt.param_groups:
                group["lr"] = self.config.lr * max(0.0, 1.0 - self.step / self.config.decay_steps)
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for b in range(self.config.batch):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.config.bf16):
                i = self.step * self.config.batch + b
                loss, _ = self.sequence_loss(self._tensors(self._sample(i)),
                                             rng=np.random.default_rng([self.config.seed, i, 1]))
            (loss / self.config.batch).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.opt.step()
        self.step += 1
        return total / self.config.batch

    def run(self, *, max_steps: int | None = None, budget_s: float | None = None,
            on_step: Callable[[int, float, dict[str, Any] | None], None] | None = None,
            checkpoint: Path | None = None, checkpoint_every_s: float = 120.0) -> None:
        """Train until ``max_steps`` (total, resumes included) or ``budget_s`` more seconds pass.

        Args:
            on_step: called as ``on_step(step, loss, eval_or_None)`` after every step.
            checkpoint: where to save (every ``checkpoint_every_s`` and at the end).
        """
        if max_steps is None and budget_s is None:
            raise ValueError("give max_steps or budget_s")
        t0 = time.monotonic()
        last_save = t0
        while (max_steps is None or self.step < max_steps) and (budget_s is None or time.monotonic() - t0 < budget_s):
            ts = time.monotonic()
            loss = self.train_step()
            self.elapsed += time.monotonic() - ts
            ev = None
            if self.val_files and self.step % self.config.eval_every == 0:
                ev = self.evaluate()
                self.history.append({"step": self.step, "loss": loss, "val_loss": ev["loss"],
                                     "acc1": ev["acceptance"][0], "elapsed": self.elapsed})
            if on_step:
                on_step(self.step, loss, ev)
            if checkpoint is not None and time.monotonic() - last_save > checkpoint_every_s:
                self.save(checkpoint)
                last_save = time.monotonic()
        if checkpoint is not None:
            self.save(checkpoint)

    # -- checkpoints and export --------------------------------------------------------------------

    def save(self, path: Path) -> None:
        """Model, optimizer, step, elapsed time and history (atomic)."""
        path = Path(path)
        tmp = path.with_suffix(".tmp")
        torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                    "elapsed": self.elapsed, "history": self.history, "train": asdict(self.config),
                    "head": asdict(self.model.config)}, tmp)
        tmp.replace(path)

    def load(self, path: Path) -> None:
        """Restore a checkpoint written by ``save`` for the same head shape."""
        state = torch.load(Path(path), weights_only=False)
        if state["head"] != asdict(self.model.config):
            raise ValueError(f"checkpoint {path} is for another head shape; delete it or change --work-dir")
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.step, self.elapsed, self.history = state["step"], state["elapsed"], state["history"]

    def export(self, path: Path, vocab_source: Path, weight_type: str = "f16",
               extra_kv: dict[str, str] | None = None) -> Path:
        """Write the head as a llama.cpp GGUF of its kind (``model.export``)."""
        return self.model.export(path, vocab_source, weight_type, extra_kv)
