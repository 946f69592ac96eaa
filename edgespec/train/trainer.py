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
index), the learning rate of the step (``lr_at``), and the model has no dropout, so a run stopped
after any step and resumed from its checkpoint continues exactly as one that never stopped, its
learning curve included (tested). Numpy randomness is only such seeded generators (no state to
save); torch's CPU generator state is saved and restored anyway.

Devices: ``Trainer(device=...)`` puts the model, the batches and the loss on a torch device
(``resolve_device``); with ``TrainConfig.bf16`` autocast is bfloat16 on cpu and cuda, none on mps
(``autocast_dtype``). ``resolve_dtype`` turns train-head's ``--dtype`` (auto, float32, bfloat16) into
that flag: auto autocasts only where bf16 is fast (``fast_bf16``: a CUDA GPU with bf16, a CPU with
avx512_bf16 or AMX), since on a CPU without bf16 instructions (AVX2 only) torch emulates it and a step
takes several times as long as in float32. Checkpoints are written from and read onto any device.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from edgespec.errors import DeviceError
from edgespec.heads.dflash import DFlashConfig
from edgespec.heads.eagle3 import Eagle3Config, random_tensors
from edgespec.train.curve import append_curve, curve_row, write_curve
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
    decay_steps: int = 0  # > 0: after the warm-up the learning rate falls to 0 at this step (``lr_at``)
    warmup_steps: int = 0  # the learning rate rises linearly from 0 to lr over this many steps
    decay_shape: str = "linear"  # linear or cosine (the fall of ``decay_steps``)

    def __post_init__(self) -> None:
        if self.decay_shape not in ("linear", "cosine"):
            raise ValueError(f"decay shape must be linear or cosine (got {self.decay_shape!r})")
        if self.warmup_steps < 0 or self.eval_every < 1:
            raise ValueError(f"need warm-up steps ≥ 0 and eval_every ≥ 1 (got {self.warmup_steps}, "
                             f"{self.eval_every})")
        if self.decay_steps and self.decay_steps <= self.warmup_steps:
            raise ValueError(f"the decay must end after the warm-up (decay to step {self.decay_steps}, "
                             f"warm-up {self.warmup_steps} steps)")


def lr_at(config: TrainConfig, step: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based): ``lr``·step/``warmup_steps`` during the
    warm-up, then ``lr``, or with ``decay_steps`` > 0 falling from ``lr`` to 0 at step ``decay_steps``
    (linearly, or along a half cosine). A pure function of the step, so a resume continues it exactly."""
    if step < config.warmup_steps:
        return config.lr * step / config.warmup_steps
    if not config.decay_steps:
        return config.lr
    frac = min(1.0, (step - config.warmup_steps) / (config.decay_steps - config.warmup_steps))
    if config.decay_shape == "cosine":
        return config.lr * 0.5 * (1.0 + math.cos(math.pi * frac))
    return config.lr * (1.0 - frac)


DEVICES = ("auto", "cpu", "cuda", "mps")


def resolve_device(name: str) -> torch.device:
    """``auto`` → cuda if torch sees one, else mps if available, else cpu; ``cpu``, ``cuda``, ``mps`` →
    that device, or a ``DeviceError`` naming it when it is absent."""
    if name not in DEVICES:
        raise DeviceError(f"--device must be one of {', '.join(DEVICES)} (got {name!r})")
    have = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if name == "auto":
        name = "cuda" if have["cuda"] else "mps" if have["mps"] else "cpu"
    if not have[name]:
        raise DeviceError(f"--device {name}: torch {torch.__version__} sees no {name.upper()} device here")
    return torch.device(name)


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The autocast dtype of training on ``device``: bfloat16 on cpu and cuda (None, float32, on a GPU
    without bf16); None on mps, where float16 without a gradient scaler lets small gradients underflow
    and bf16 needs macOS 14."""
    if device.type == "mps" or (device.type == "cuda" and not torch.cuda.is_bf16_supported()):
        return None
    return torch.bfloat16


DTYPES = ("auto", "float32", "bfloat16")
# /proc/cpuinfo flags of CPUs whose bf16 matmuls run in hardware (AVX512-BF16: Cooper Lake, Zen 4 and
# later; AMX: Sapphire Rapids and later); without them torch's CPU bf16 is emulated and slower than float32
FAST_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (x86 ``flags``, arm ``Features``); empty elsewhere."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return frozenset()
    for ln in text.splitlines():
        key, _, value = ln.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def fast_bf16(device: torch.device, flags: frozenset[str] | None = None) -> bool:
    """Whether bfloat16 autocast speeds training up on ``device``: a CUDA GPU with bf16 support, or a CPU
    reporting one of ``FAST_BF16_CPU_FLAGS`` (``flags``: default ``cpu_flags()``); never on mps."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if device.type == "cpu":
        return bool((cpu_flags() if flags is None else flags) & FAST_BF16_CPU_FLAGS)
    return False


def resolve_dtype(name: str, device: torch.device) -> bool:
    """train-head's ``--dtype`` as ``TrainConfig.bf16``: ``auto`` → ``fast_bf16(device)``, ``float32`` →
    False, ``bfloat16`` → True (autocast; weights and optimizer stay float32; on mps ``autocast_dtype``
    still runs float32). A ``ValueError`` names a bad value."""
    if name not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)} (got {name!r})")
    return fast_bf16(device) if name == "auto" else name == "bfloat16"


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


def sequence_tensors(path: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """One cached sequence (``FeatureCache.load_file``) as the trainer's tensors on ``device``: tokens and
    top_ids int64, feats and top_lp float32, n_prompt (kept on the CPU: it is read as an int)."""
    z = FeatureCache.load_file(path)
    arrays = {"tokens": z["tokens"].astype(np.int64), "feats": z["feats"],
              "top_ids": z["top_ids"].astype(np.int64), "top_lp": z["top_lp"].astype(np.float32)}
    out = {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in arrays.items()}
    out["n_prompt"] = torch.tensor(int(z["n_prompt"]))
    return out


class Trainer:
    """Trains ``model`` on the files of ``cache`` (``train_files``), evaluating on ``val_files``.

    Args:
        model: the head (its d2t fixes the draft vocabulary); moved to ``device``.
        train_files, val_files: ``seq_*.npz`` paths (see ``features``).
        config: optimisation settings.
        device: where the model, the batches and the loss live (``resolve_device`` turns ``auto`` into one).
    """

    def __init__(self, model: TrainableHead, train_files: Sequence[Path], val_files: Sequence[Path],
                 config: TrainConfig, device: torch.device | str = "cpu") -> None:
        if not train_files:
            raise ValueError("no training sequences in the feature cache")
        self.device = torch.device(device)
        self.model, self.config = model.to(self.device), config
        self.train_files, self.val_files = list(train_files), list(val_files)
        t2d = target_to_draft(model.d2t.cpu().numpy(), model.config.n_vocab)
        self.t2d = torch.tensor(t2d, device=self.device)
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr,
                                     weight_decay=config.weight_decay)
        self.step = 0
        self.elapsed = 0.0  # training seconds over all runs (resumes included)
        self.tokens = 0  # training tokens seen: the tokens of every sequence read (see ``curve``)
        self.history: list[dict[str, Any]] = []  # the curve's rows (``curve.curve_row``)
        self.window: list[float] = []  # step losses since the last evaluation

    # -- data --------------------------------------------------------------------------------------

    def _sample(self, i: int) -> Path:
        """The i-th training sample: epoch i // n, in that epoch's seeded permutation."""
        n = len(self.train_files)
        order = np.random.default_rng([self.config.seed, i // n]).permutation(n)
        return self.train_files[order[i % n]]

    def _tensors(self, path: Path) -> dict[str, torch.Tensor]:
        return sequence_tensors(path, self.device)

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
        """One AdamW step over ``batch`` sequences at the learning rate ``lr_at(config, step)``;
        returns the mean loss."""
        self.model.train()
        for group in self.opt.param_groups:
            group["lr"] = lr_at(self.config, self.step)
        self.opt.zero_grad(set_to_none=True)
        dtype = autocast_dtype(self.device) if self.config.bf16 else None
        total = 0.0
        for b in range(self.config.batch):
            i = self.step * self.config.batch + b
            seq = self._tensors(self._sample(i))
            with (torch.autocast(self.device.type, dtype=dtype) if dtype else contextlib.nullcontext()):
                loss, _ = self.sequence_loss(seq, rng=np.random.default_rng([self.config.seed, i, 1]))
            (loss / self.config.batch).backward()
            total += float(loss.detach())
            self.tokens += len(seq["tokens"])
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.opt.step()
        self.step += 1
        return total / self.config.batch

    def run(self, *, max_steps: int | None = None, budget_s: float | None = None,
            on_step: Callable[[int, float, dict[str, Any] | None], None] | None = None,
            checkpoint: Path | None = None, checkpoint_every_s: float = 120.0, curve: Path | None = None) -> None:
        """Train until ``max_steps`` (total, resumes included) or ``budget_s`` more seconds pass,
        evaluating every ``config.eval_every`` steps.

        Args:
            on_step: called as ``on_step(step, loss, eval_or_None)`` after every step.
            checkpoint: where to save (every ``checkpoint_every_s`` and at the end).
            curve: the learning-curve CSV (``curve``): rewritten from ``history`` first (so rows a
                crashed session wrote after its checkpoint go), then one row appended per evaluation.
        """
        if max_steps is None and budget_s is None:
            raise ValueError("give max_steps or budget_s")
        if curve is not None:
            write_curve(curve, self.history)
        t0 = time.monotonic()
        last_save = t0
        while (max_steps is None or self.step < max_steps) and (budget_s is None or time.monotonic() - t0 < budget_s):
            ts = time.monotonic()
            loss = self.train_step()
            self.elapsed += time.monotonic() - ts
            self.window.append(loss)
            ev = None
            if self.val_files and self.step % self.config.eval_every == 0:
                ev = self.evaluate()
                self.history.append(curve_row(self.step, self.tokens, float(np.mean(self.window)), ev, self.elapsed))
                self.window = []
                if curve is not None:
                    append_curve(curve, self.history)
            if on_step:
                on_step(self.step, loss, ev)
            if checkpoint is not None and time.monotonic() - last_save > checkpoint_every_s:
                self.save(checkpoint)
                last_save = time.monotonic()
        if checkpoint is not None:
            self.save(checkpoint)

    # -- checkpoints and export --------------------------------------------------------------------

    def save(self, path: Path) -> None:
        """Model, optimizer, step, tokens seen, elapsed time, curve rows, the loss window, torch's CPU
        RNG state and the number of training files (atomic)."""
        path = Path(path)
        tmp = path.with_suffix(".tmp")
        torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                    "tokens": self.tokens, "elapsed": self.elapsed, "history": self.history,
                    "window": self.window, "torch_rng": torch.random.get_rng_state(),
                    "train": asdict(self.config), "head": asdict(self.model.config),
                    "n_train": len(self.train_files)}, tmp)
        tmp.replace(path)

    def load(self, path: Path) -> dict[str, Any]:
        """Restore a checkpoint written by ``save`` for the same head shape, on this trainer's device.

        Returns:
            the ``TrainConfig`` fields the checkpoint was trained with (as a dict), and ``n_train``,
            its number of training files, where it recorded one.
        """
        state = torch.load(Path(path), map_location="cpu", weights_only=False)
        if state["head"] != asdict(self.model.config):
            raise ValueError(f"checkpoint {path} is for another head shape; delete it or change --work-dir")
        self.model.load_state_dict(state["model"])  # copies onto the parameters' device
        self.opt.load_state_dict(state["opt"])  # AdamW moves its moments to the parameters' device
        self.step, self.elapsed = state["step"], state["elapsed"]
        # rows of checkpoints older than the curve CSV have no token count to plot against: dropped
        self.history = [r for r in state["history"] if "tokens" in r]
        # checkpoints written before tokens/window/RNG were saved resume with the counts restarted
        self.tokens, self.window = state.get("tokens", 0), state.get("window", [])
        if "torch_rng" in state:
            torch.random.set_rng_state(state["torch_rng"])
        return dict(state["train"]) | ({"n_train": state["n_train"]} if "n_train" in state else {})

    def export(self, path: Path, vocab_source: Path, weight_type: str = "f16",
               extra_kv: dict[str, str] | None = None) -> Path:
        """Write the head as a llama.cpp GGUF of its kind (``model.export``)."""
        return self.model.export(path, vocab_source, weight_type, extra_kv)
