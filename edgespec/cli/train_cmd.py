"""`edgespec train-head --target X --kind eagle3|dflash|dspark|medusa --out head.gguf`: self-distil a head
(needs the `train` extra: torch)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgespec.cli.options import flag, with_options
from edgespec.errors import EdgespecError, MissingDependencyError

_KINDS = ("eagle3", "dflash", "dspark", "medusa")
_TORCH_HINT = "torch is not installed: pip install 'edgespec[train]' (the train extra)"
_DATA, _OPT, _HEAD = "Training data", "Optimisation", "Head shape and runtime"


@dataclass(frozen=True)
class TrainOptions:
    """train-head's flags, each declared once: its default, help and --help panel (`flag`)."""

    target: str = flag(..., "Target GGUF file or known model name.")
    out: Path = flag(..., "Head GGUF to write (llama.cpp's eagle3 or dflash layout, edgespec's medusa layout).")
    kind: str = flag("eagle3", "Head type: eagle3, dflash, dspark (Markov and confidence heads on a frozen "
                     "--base DFlash head) or medusa (heads on the target's final-norm hidden state, sharing "
                     "its LM head).")
    budget_min: float = flag(10.0, "Training time in minutes of this session (feature extraction not counted; 0: "
                             "no limit, needs --max-steps).")
    max_steps: int = flag(0, "Planned total optimizer steps over all --resume sessions: training stops there and "
                          "--lr-decay ends there (0: only the budget).")
    resume: bool = flag(False, "Continue from the work directory's checkpoint.")

    # the training data
    seed: int = flag(0, "Seed of data order, corpus order and initialisation.", _DATA)
    draft_vocab: int = flag(8192, "Draft vocabulary size (most frequent target tokens of the training data).", _DATA)
    corpus_chars: int = flag(1_000_000, "Cap on local corpus text.", _DATA)
    prompts: int = flag(-1, "Training prompts whose greedy generations are used (−1: all).", _DATA)
    gen_tokens: int = flag(192, "Tokens generated per prompt.", _DATA)
    gen_prompts: int = flag(0, "Generated prompts (chat, code, editing, summarising, JSON, stories, multi-turn) "
                            "whose replies are self-distilled in batches (0: none).", _DATA)
    n_seq: int = flag(8, "Replies generated at once (one llama.cpp decode per step for all).", _DATA)
    greedy_share: float = flag(0.5, "Share of generated replies that are greedy (the rest sampled at T 0.7–1.0).",
                               _DATA)
    heldout_gen: int = flag(0, "More generated prompts (drawn first) whose replies are held out: evaluated, never "
                            "trained on. Rerunning with more --gen-prompts grows the data.", _DATA)

    # the optimisation
    ttt_steps: int = flag(4, "Training-time-test depth.", _OPT)
    lr: float = flag(5e-4, "AdamW learning rate.", _OPT)
    lr_decay: bool = flag(False, "Let the learning rate fall to 0 at --max-steps (default: constant).", _OPT)
    decay_shape: str = flag("linear", "Shape of --lr-decay: linear or cosine.", _OPT)
    warmup_steps: int = flag(0, "Linear learning-rate warm-up from 0 over this many steps.", _OPT)
    eval_every: int = flag(50, "Held-out evaluation (a row of the work directory's curve CSV) every N steps.", _OPT)

    # the head's shape, and where it all runs
    weight_type: str = flag("f16", "f16 or q8_0 (2-D weights).", _HEAD)
    block_size: int = flag(8, "dflash: block size B (anchor + B−1 drafts).", _HEAD)
    dflash_layers: int = flag(1, "dflash: decoder layers.", _HEAD)
    base: Path | None = flag(None, "dspark: the trained DFlash head GGUF (kept frozen).", _HEAD)
    markov_rank: int = flag(32, "dspark: rank R of the Markov head.", _HEAD)
    medusa_heads: int = flag(4, "medusa: heads K (head k drafts the token k + 2 after the hidden state's).", _HEAD)
    medusa_layers: int = flag(1, "medusa: residual blocks per head.", _HEAD)
    device: str = flag("auto", "Torch device: auto (cuda, else mps, else cpu), cpu, cuda or mps.", _HEAD)
    dtype: str = flag("auto", "Training precision: auto (bfloat16 autocast where bf16 is fast: a CUDA GPU with bf16, "
                      "a CPU with avx512_bf16 or AMX; float32 otherwise, e.g. on an AVX2-only CPU, where emulated "
                      "bf16 is several times slower), float32 or bfloat16.", _HEAD)
    threads: int = flag(0, "CPU threads (llama.cpp and torch; 0: default).", _HEAD)
    work_dir: Path | None = flag(None, "Feature cache and checkpoints (default $EDGESPEC_HOME/train/<target>).",
                                 _HEAD)


@with_options(TrainOptions)
def train_head(opts: TrainOptions) -> None:
    """Train a feature head for a target by self-distillation.

    Trains a speculative-decoding head (EAGLE-3, DFlash, DSpark or Medusa) for the
    --target model on its own greedy continuations and writes it as a GGUF
    (needs the `train` extra: torch).
    """
    _check(opts)
    try:
        import torch
    except ImportError as e:
        raise MissingDependencyError(_TORCH_HINT) from e
    from edgespec.train.pipeline import train_head as run
    from edgespec.train.trainer import resolve_device

    resolved = resolve_device(opts.device)  # an absent device fails here, before minutes of feature extraction
    if opts.threads:
        torch.set_num_threads(opts.threads)
    with _TrainProgress() as bar:
        from edgespec.cli import ui

        summary = run(_job(opts, resolved.type), note=ui.status, progress=bar.extract, on_step=bar.step)
    _report(summary, resolved.type)


def _check(f: TrainOptions) -> None:
    """One line for the first flag (or pair of flags) that does not make sense."""
    if f.kind not in _KINDS:
        raise EdgespecError(f"--kind must be one of {', '.join(_KINDS)} (got {f.kind!r})")
    if f.kind == "dspark" and f.base is None:
        raise EdgespecError("--kind dspark needs --base, a DFlash head GGUF trained with --kind dflash")
    if f.kind != "dspark" and f.base is not None:
        raise EdgespecError(f"--base is for --kind dspark only (got --kind {f.kind})")
    if f.medusa_heads < 1 or f.medusa_layers < 1:
        raise EdgespecError(f"need --medusa-heads ≥ 1 and --medusa-layers ≥ 1 (got {f.medusa_heads}, "
                            f"{f.medusa_layers})")
    if f.block_size < 2 or f.dflash_layers < 1 or f.markov_rank < 1:
        raise EdgespecError(f"need --block-size ≥ 2, --dflash-layers ≥ 1, --markov-rank ≥ 1 (got {f.block_size}, "
                            f"{f.dflash_layers}, {f.markov_rank})")
    if f.lr_decay and not f.max_steps:
        raise EdgespecError("--lr-decay needs --max-steps (the learning rate reaches 0 at the last step)")
    if f.decay_shape not in ("linear", "cosine") or (f.decay_shape == "cosine" and not f.lr_decay):
        raise EdgespecError(f"--decay-shape must be linear or cosine, and cosine needs --lr-decay "
                            f"(got {f.decay_shape!r})")
    if f.warmup_steps < 0 or f.eval_every < 1 or (f.lr_decay and f.warmup_steps >= f.max_steps):
        raise EdgespecError(f"need --warmup-steps ≥ 0 (and < --max-steps with --lr-decay) and --eval-every ≥ 1 "
                            f"(got {f.warmup_steps}, {f.eval_every}; --max-steps {f.max_steps})")
    if f.budget_min <= 0 and not f.max_steps:
        raise EdgespecError(f"--budget-min {f.budget_min:g} (no time limit) needs --max-steps")
    if f.gen_prompts < 0 or f.heldout_gen < 0 or f.n_seq < 1 or not 0.0 <= f.greedy_share <= 1.0:
        raise EdgespecError(f"need --gen-prompts ≥ 0, --heldout-gen ≥ 0, --n-seq ≥ 1 and --greedy-share in [0, 1] "
                            f"(got {f.gen_prompts}, {f.heldout_gen}, {f.n_seq}, {f.greedy_share:g})")
    if f.dtype not in ("auto", "float32", "bfloat16"):
        raise EdgespecError(f"--dtype must be one of auto, float32, bfloat16 (got {f.dtype!r})")
    if f.weight_type not in ("f16", "q8_0"):
        raise EdgespecError(f"--weight-type must be f16 or q8_0 (got {f.weight_type!r})")


def _job(f: TrainOptions, device: str) -> Any:
    """The pipeline's HeadJob for these flags (the target resolved: the one place a name becomes a path)."""
    import torch

    from edgespec.models import resolve_model
    from edgespec.train import prompts as P
    from edgespec.train.pipeline import HeadJob
    from edgespec.train.trainer import TrainConfig, resolve_dtype

    same = ("out", "kind", "seed", "draft_vocab", "resume", "weight_type", "corpus_chars", "gen_tokens", "work_dir",
            "block_size", "dflash_layers", "base", "markov_rank", "lr_decay", "gen_prompts", "n_seq", "greedy_share",
            "heldout_gen", "medusa_heads", "medusa_layers")
    return HeadJob(target=resolve_model(f.target), budget_s=f.budget_min * 60 if f.budget_min > 0 else None,
                   max_steps=f.max_steps or None, threads=f.threads or None, device=device,
                   n_prompts=len(P.TRAIN_PROMPTS) if f.prompts < 0 else f.prompts,
                   train=TrainConfig(ttt_steps=f.ttt_steps, lr=f.lr, eval_every=f.eval_every,
                                     warmup_steps=f.warmup_steps, decay_shape=f.decay_shape,
                                     bf16=resolve_dtype(f.dtype, torch.device(device))),
                   **{k: getattr(f, k) for k in same})


def _report(summary: dict[str, Any], device: str) -> None:
    """What was written, the held-out acceptance by position and set, and the learning curve's fit."""
    from edgespec.cli import ui

    end = summary["end"]
    acc = " ".join(f"{a:.2f}" for a in end["acceptance"]) if end else "n/a"
    tau = f" (τ ≈ {end['tau']:.2f})" if end else ""
    ui.status(f"wrote {summary['out']} after {summary['steps']} steps ({summary['seconds']:.0f} s, "
              f"{summary['tokens']} tokens on {device}); held-out top-1 acceptance by position: {acc}{tau}")
    for name, ev in summary["by_set"].items():
        ui.status(f"  {name}: " + " ".join(f"{a:.2f}" for a in ev["acceptance"]) + f" (τ ≈ {ev['tau']:.2f})")
    fit = summary["projection"]
    if fit is not None:
        goal = (f"τ {fit.goal:g} at ≈ {fit.goal_tokens:.3g} training tokens" if fit.goal_tokens
                else f"no rise towards τ {fit.goal:g}")
        ui.status(f"learning curve over the first pass ({summary['data_tokens']} data tokens, {fit.rows} rows): "
                  f"τ ≈ {fit.a:.2f} + {fit.b:.3f}·ln(tokens); {goal} (a log-linear extrapolation)")
    else:
        ui.status(f"no projection: fewer than 3 curve rows (after the first) within the first pass over the data "
                  f"({summary['data_tokens']} tokens); a smaller --eval-every gives more")


class _TrainProgress:
    """Rich bars: feature extraction (sequences) and training (steps, loss, held-out acceptance)."""

    def __enter__(self) -> _TrainProgress:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=Console(stderr=True))
        self._p.__enter__()
        self._tasks: dict[str, Any] = {}
        self._acc = "acc1 –"
        return self

    def __exit__(self, *exc: object) -> None:
        self._p.__exit__(None, None, None)

    def extract(self, phase: str, done: int, total: int) -> None:
        if phase not in self._tasks:
            self._tasks[phase] = self._p.add_task(phase, total=total, info="")
        self._p.update(self._tasks[phase], completed=done, total=total)

    def step(self, step: int, loss: float, ev: dict[str, Any] | None) -> None:
        if "train" not in self._tasks:
            self._tasks["train"] = self._p.add_task("training", total=None, info="")
        if ev is not None:
            self._acc = f"held-out loss {ev['loss']:.3f} acc1 {ev['acceptance'][0]:.3f} τ {ev['tau']:.2f}"
        self._p.update(self._tasks["train"], completed=step, info=f"loss {loss:.3f}  {self._acc}")
