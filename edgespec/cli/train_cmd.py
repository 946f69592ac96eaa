"""`edgespec train-head --target X --kind eagle3|dflash|dspark --out head.gguf`: self-distil a feature head
(needs the `train` extra: torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from edgespec.errors import EdgespecError, MissingDependencyError

_KINDS = ("eagle3", "dflash", "dspark")
_TORCH_HINT = "torch is not installed: pip install 'edgespec[train]' (the train extra)"


# one alias per option (the command's signature stays one line an option)
_Target = Annotated[str, typer.Option("--target", help="Target GGUF file or known model name.")]
_Out = Annotated[Path, typer.Option("--out", help="Head GGUF to write (llama.cpp's eagle3 or dflash layout).")]
_Kind = Annotated[str, typer.Option("--kind", help="Head type: eagle3, dflash, or dspark (Markov and confidence "
    "heads on a frozen --base DFlash head).")]
_BudgetMin = Annotated[float, typer.Option("--budget-min", help="Training time in minutes of this session (feature "
    "extraction not counted; 0: no limit, needs --max-steps).")]
_MaxSteps = Annotated[int, typer.Option("--max-steps", help="Planned total optimizer steps over all --resume "
    "sessions: training stops there and --lr-decay ends there (0: only the budget).")]
_Seed = Annotated[int, typer.Option("--seed", help="Seed of data order, corpus order and initialisation.")]
_DraftVocab = Annotated[int, typer.Option("--draft-vocab", help="Draft vocabulary size (most frequent target tokens "
    "of the training data).")]
_Resume = Annotated[bool, typer.Option("--resume", help="Continue from the work directory's checkpoint.")]
_WeightType = Annotated[str, typer.Option("--weight-type", help="f16 or q8_0 (2-D weights).")]
_CorpusChars = Annotated[int, typer.Option("--corpus-chars", help="Cap on local corpus text.")]
_Prompts = Annotated[int, typer.Option("--prompts", help="Training prompts whose greedy generations are used (−1: "
    "all).")]
_GenTokens = Annotated[int, typer.Option("--gen-tokens", help="Tokens generated per prompt.")]
_GenPrompts = Annotated[int, typer.Option("--gen-prompts", help="Generated prompts (chat, code, editing, "
    "summarising, JSON, stories, multi-turn) whose replies are self-distilled in batches (0: none).")]
_NSeq = Annotated[int, typer.Option("--n-seq", help="Replies generated at once (one llama.cpp decode per step for "
    "all).")]
_GreedyShare = Annotated[float, typer.Option("--greedy-share", help="Share of generated replies that are greedy (the "
    "rest sampled at T 0.7–1.0).")]
_HeldoutGen = Annotated[int, typer.Option("--heldout-gen", help="More generated prompts (drawn first) whose replies "
    "are held out: evaluated, never trained on. Rerunning with more --gen-prompts grows the data.")]
_TttSteps = Annotated[int, typer.Option("--ttt-steps", help="Training-time-test depth.")]
_Lr = Annotated[float, typer.Option("--lr", help="AdamW learning rate.")]
_LrDecay = Annotated[bool, typer.Option("--lr-decay", help="Let the learning rate fall to 0 at --max-steps (default: "
    "constant).")]
_DecayShape = Annotated[str, typer.Option("--decay-shape", help="Shape of --lr-decay: linear or cosine.")]
_WarmupSteps = Annotated[int, typer.Option("--warmup-steps", help="Linear learning-rate warm-up from 0 over this "
    "many steps.")]
_EvalEvery = Annotated[int, typer.Option("--eval-every", help="Held-out evaluation (a row of the work directory's "
    "curve CSV) every N steps.")]
_Device = Annotated[str, typer.Option("--device", help="Torch device: auto (cuda, else mps, else cpu), cpu, cuda or "
    "mps.")]
_BlockSize = Annotated[int, typer.Option("--block-size", help="dflash: block size B (anchor + B−1 drafts).")]
_DflashLayers = Annotated[int, typer.Option("--dflash-layers", help="dflash: decoder layers.")]
_Base = Annotated[Path | None, typer.Option("--base", help="dspark: the trained DFlash head GGUF (kept frozen).")]
_MarkovRank = Annotated[int, typer.Option("--markov-rank", help="dspark: rank R of the Markov head.")]
_Threads = Annotated[int, typer.Option("--threads", help="CPU threads (llama.cpp and torch; 0: default).")]
_WorkDir = Annotated[Path | None, typer.Option("--work-dir", help="Feature cache and checkpoints (default "
    "$EDGESPEC_HOME/train/<target>).")]


def train_head(
    target: _Target,
    out: _Out,
    kind: _Kind = "eagle3",
    budget_min: _BudgetMin = 10.0,
    max_steps: _MaxSteps = 0,
    seed: _Seed = 0,
    draft_vocab: _DraftVocab = 8192,
    resume: _Resume = False,
    weight_type: _WeightType = "f16",
    corpus_chars: _CorpusChars = 1_000_000,
    prompts: _Prompts = -1,
    gen_tokens: _GenTokens = 192,
    gen_prompts: _GenPrompts = 0,
    n_seq: _NSeq = 8,
    greedy_share: _GreedyShare = 0.5,
    heldout_gen: _HeldoutGen = 0,
    ttt_steps: _TttSteps = 4,
    lr: _Lr = 5e-4,
    lr_decay: _LrDecay = False,
    decay_shape: _DecayShape = "linear",
    warmup_steps: _WarmupSteps = 0,
    eval_every: _EvalEvery = 50,
    device: _Device = "auto",
    block_size: _BlockSize = 8,
    dflash_layers: _DflashLayers = 1,
    base: _Base = None,
    markov_rank: _MarkovRank = 32,
    threads: _Threads = 0,
    work_dir: _WorkDir = None,
) -> None:
    """Train a feature head for a target by self-distillation.

    Trains a speculative-decoding head (EAGLE-3, DFlash or DSpark) for the
    --target model on its own greedy continuations and writes it as a GGUF
    (needs the `train` extra: torch).
    """
    flags = dict(locals())  # every option by name, for the checks and the job
    _check(flags)
    try:
        import torch
    except ImportError as e:
        raise MissingDependencyError(_TORCH_HINT) from e
    from edgespec.train.pipeline import train_head as run
    from edgespec.train.trainer import resolve_device

    resolved = resolve_device(device)  # an absent device fails here, before minutes of feature extraction
    if threads:
        torch.set_num_threads(threads)
    with _TrainProgress() as bar:
        from edgespec.cli import ui

        summary = run(_job(flags, resolved.type), note=ui.status, progress=bar.extract, on_step=bar.step)
    _report(summary, resolved.type)


def _check(f: dict[str, Any]) -> None:
    """One line for the first flag (or pair of flags) that does not make sense."""
    if f["kind"] not in _KINDS:
        raise EdgespecError(f"--kind must be one of {', '.join(_KINDS)} (got {f['kind']!r})")
    if f["kind"] == "dspark" and f["base"] is None:
        raise EdgespecError("--kind dspark needs --base, a DFlash head GGUF trained with --kind dflash")
    if f["block_size"] < 2 or f["dflash_layers"] < 1 or f["markov_rank"] < 1:
        raise EdgespecError(f"need --block-size ≥ 2, --dflash-layers ≥ 1, --markov-rank ≥ 1 (got {f['block_size']}, "
                            f"{f['dflash_layers']}, {f['markov_rank']})")
    if f["lr_decay"] and not f["max_steps"]:
        raise EdgespecError("--lr-decay needs --max-steps (the learning rate reaches 0 at the last step)")
    if f["decay_shape"] not in ("linear", "cosine") or (f["decay_shape"] == "cosine" and not f["lr_decay"]):
        raise EdgespecError(f"--decay-shape must be linear or cosine, and cosine needs --lr-decay "
                            f"(got {f['decay_shape']!r})")
    if f["warmup_steps"] < 0 or f["eval_every"] < 1 or (f["lr_decay"] and f["warmup_steps"] >= f["max_steps"]):
        raise EdgespecError(f"need --warmup-steps ≥ 0 (and < --max-steps with --lr-decay) and --eval-every ≥ 1 "
                            f"(got {f['warmup_steps']}, {f['eval_every']}; --max-steps {f['max_steps']})")
    if f["budget_min"] <= 0 and not f["max_steps"]:
        raise EdgespecError(f"--budget-min {f['budget_min']:g} (no time limit) needs --max-steps")
    if f["gen_prompts"] < 0 or f["heldout_gen"] < 0 or f["n_seq"] < 1 or not 0.0 <= f["greedy_share"] <= 1.0:
        raise EdgespecError(f"need --gen-prompts ≥ 0, --heldout-gen ≥ 0, --n-seq ≥ 1 and --greedy-share in [0, 1] "
                            f"(got {f['gen_prompts']}, {f['heldout_gen']}, {f['n_seq']}, {f['greedy_share']:g})")
    if f["weight_type"] not in ("f16", "q8_0"):
        raise EdgespecError(f"--weight-type must be f16 or q8_0 (got {f['weight_type']!r})")


def _job(f: dict[str, Any], device: str) -> Any:
    """The pipeline's HeadJob for these flags (the target resolved: the one place a name becomes a path)."""
    from edgespec.models import resolve_model
    from edgespec.train import prompts as P
    from edgespec.train.pipeline import HeadJob
    from edgespec.train.trainer import TrainConfig

    same = ("out", "kind", "seed", "draft_vocab", "resume", "weight_type", "corpus_chars", "gen_tokens", "work_dir",
            "block_size", "dflash_layers", "base", "markov_rank", "lr_decay", "gen_prompts", "n_seq", "greedy_share",
            "heldout_gen")
    return HeadJob(target=resolve_model(f["target"]), budget_s=f["budget_min"] * 60 if f["budget_min"] > 0 else None,
                   max_steps=f["max_steps"] or None, threads=f["threads"] or None, device=device,
                   n_prompts=len(P.TRAIN_PROMPTS) if f["prompts"] < 0 else f["prompts"],
                   train=TrainConfig(ttt_steps=f["ttt_steps"], lr=f["lr"], eval_every=f["eval_every"],
                                     warmup_steps=f["warmup_steps"], decay_shape=f["decay_shape"]),
                   **{k: f[k] for k in same})


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
