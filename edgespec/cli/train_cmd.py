"""`edgespec train-head --target X --kind eagle3|dflash|dspark --out head.gguf`: self-distil a feature head
(needs the `train` extra: torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from edgespec.errors import EdgespecError, MissingDependencyError

_KINDS = ("eagle3", "dflash", "dspark")
_TORCH_HINT = "torch is not installed: pip install 'edgespec[train]' (the train extra)"


def train_head(
    target: Annotated[str, typer.Option("--target", help="Target GGUF file or known model name.")],
    out: Annotated[Path, typer.Option("--out", help="Head GGUF to write (llama.cpp's eagle3 or dflash layout).")],
    kind: Annotated[str, typer.Option("--kind", help="Head type: eagle3, dflash, or dspark (Markov and "
                                                     "confidence heads on a frozen --base DFlash head).")] = "eagle3",
    budget_min: Annotated[float, typer.Option("--budget-min", help="Training time in minutes of this session "
                                                                   "(feature extraction not counted; 0: no "
                                                                   "limit, needs --max-steps).")] = 10.0,
    max_steps: Annotated[int, typer.Option("--max-steps", help="Planned total optimizer steps over all "
                                                               "--resume sessions: training stops there and "
                                                               "--lr-decay ends there (0: only the budget).")] = 0,
    seed: Annotated[int, typer.Option("--seed", help="Seed of data order, corpus order and initialisation.")] = 0,
    draft_vocab: Annotated[int, typer.Option("--draft-vocab", help="Draft vocabulary size (most frequent "
                                                                   "target tokens of the training data).")] = 8192,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the work directory's checkpoint.")] = False,
    weight_type: Annotated[str, typer.Option("--weight-type", help="f16 or q8_0 (2-D weights).")] = "f16",
    corpus_chars: Annotated[int, typer.Option("--corpus-chars", help="Cap on local corpus text.")] = 1_000_000,
    prompts: Annotated[int, typer.Option("--prompts", help="Training prompts whose greedy generations "
                                                           "are used (−1: all).")] = -1,
    gen_tokens: Annotated[int, typer.Option("--gen-tokens", help="Tokens generated per prompt.")] = 192,
    gen_prompts: Annotated[int, typer.Option("--gen-prompts", help="Generated prompts (chat, code, editing, "
                                                                   "summarising, JSON, stories, multi-turn) "
                                                                   "whose replies are self-distilled in "
                                                                   "batches (0: none).")] = 0,
    n_seq: Annotated[int, typer.Option("--n-seq", help="Replies generated at once (one llama.cpp decode per "
                                                       "step for all).")] = 8,
    greedy_share: Annotated[float, typer.Option("--greedy-share", help="Share of generated replies that are "
                                                                       "greedy (the rest sampled at T "
                                                                       "0.7–1.0).")] = 0.5,
    heldout_gen: Annotated[int, typer.Option("--heldout-gen", help="More generated prompts (drawn first) whose "
                                                                   "replies are held out: evaluated, never "
                                                                   "trained on. Rerunning with more "
                                                                   "--gen-prompts grows the data.")] = 0,
    ttt_steps: Annotated[int, typer.Option("--ttt-steps", help="Training-time-test depth.")] = 4,
    lr: Annotated[float, typer.Option("--lr", help="AdamW learning rate.")] = 5e-4,
    lr_decay: Annotated[bool, typer.Option("--lr-decay", help="Let the learning rate fall to 0 at "
                                                              "--max-steps (default: constant).")] = False,
    decay_shape: Annotated[str, typer.Option("--decay-shape", help="Shape of --lr-decay: linear or "
                                                                   "cosine.")] = "linear",
    warmup_steps: Annotated[int, typer.Option("--warmup-steps", help="Linear learning-rate warm-up from 0 "
                                                                     "over this many steps.")] = 0,
    eval_every: Annotated[int, typer.Option("--eval-every", help="Held-out evaluation (a row of the work "
                                                                 "directory's curve CSV) every N steps.")] = 50,
    device: Annotated[str, typer.Option("--device", help="Torch device: auto (cuda, else mps, else cpu), "
                                                         "cpu, cuda or mps.")] = "auto",
    block_size: Annotated[int, typer.Option("--block-size", help="dflash: block size B (anchor + B−1 "
                                                                 "drafts).")] = 8,
    dflash_layers: Annotated[int, typer.Option("--dflash-layers", help="dflash: decoder layers.")] = 1,
    base: Annotated[Path | None, typer.Option("--base", help="dspark: the trained DFlash head GGUF "
                                                             "(kept frozen).")] = None,
    markov_rank: Annotated[int, typer.Option("--markov-rank", help="dspark: rank R of the Markov "
                                                                   "head.")] = 32,
    threads: Annotated[int, typer.Option("--threads", help="CPU threads (llama.cpp and torch; 0: default).")] = 0,
    work_dir: Annotated[Path | None, typer.Option("--work-dir", help="Feature cache and checkpoints "
                                                                     "(default $EDGESPEC_HOME/train/<target>).")] = None,
) -> None:
    """Train a feature head for a target by self-distillation.

    Trains a speculative-decoding head (EAGLE-3, DFlash or DSpark) for the
    --target model on its own greedy continuations and writes it as a GGUF
    (needs the `train` extra: torch).
    """
    from edgespec.cli import ui

    if kind not in _KINDS:
        raise EdgespecError(f"--kind must be one of {', '.join(_KINDS)} (got {kind!r})")
    if kind == "dspark" and base is None:
        raise EdgespecError("--kind dspark needs --base, a DFlash head GGUF trained with --kind dflash")
    if block_size < 2 or dflash_layers < 1 or markov_rank < 1:
        raise EdgespecError(f"need --block-size ≥ 2, --dflash-layers ≥ 1, --markov-rank ≥ 1 (got {block_size}, "
                            f"{dflash_layers}, {markov_rank})")
    if lr_decay and not max_steps:
        raise EdgespecError("--lr-decay needs --max-steps (the learning rate reaches 0 at the last step)")
    if decay_shape not in ("linear", "cosine") or (decay_shape == "cosine" and not lr_decay):
        raise EdgespecError(f"--decay-shape must be linear or cosine, and cosine needs --lr-decay "
                            f"(got {decay_shape!r})")
    if warmup_steps < 0 or eval_every < 1 or (lr_decay and warmup_steps >= max_steps):
        raise EdgespecError(f"need --warmup-steps ≥ 0 (and < --max-steps with --lr-decay) and --eval-every ≥ 1 "
                            f"(got {warmup_steps}, {eval_every}; --max-steps {max_steps})")
    if budget_min <= 0 and not max_steps:
        raise EdgespecError(f"--budget-min {budget_min:g} (no time limit) needs --max-steps")
    if gen_prompts < 0 or heldout_gen < 0 or n_seq < 1 or not 0.0 <= greedy_share <= 1.0:
        raise EdgespecError(f"need --gen-prompts ≥ 0, --heldout-gen ≥ 0, --n-seq ≥ 1 and --greedy-share in [0, 1] "
                            f"(got {gen_prompts}, {heldout_gen}, {n_seq}, {greedy_share:g})")
    if weight_type not in ("f16", "q8_0"):
        raise EdgespecError(f"--weight-type must be f16 or q8_0 (got {weight_type!r})")
    try:
        import torch
    except ImportError as e:
        raise MissingDependencyError(_TORCH_HINT) from e
    from edgespec.models import resolve_model
    from edgespec.train import prompts as P
    from edgespec.train.pipeline import HeadJob
    from edgespec.train.pipeline import train_head as run
    from edgespec.train.trainer import TrainConfig, resolve_device

    resolved = resolve_device(device)  # an absent device fails here, before minutes of feature extraction
    if threads:
        torch.set_num_threads(threads)
    budget_s = budget_min * 60 if budget_min > 0 else None
    job = HeadJob(target=resolve_model(target), out=out, kind=kind, budget_s=budget_s,
                  max_steps=max_steps or None, seed=seed, draft_vocab=draft_vocab, resume=resume,
                  weight_type=weight_type, corpus_chars=corpus_chars,
                  n_prompts=len(P.TRAIN_PROMPTS) if prompts < 0 else prompts, gen_tokens=gen_tokens,
                  threads=threads or None, work_dir=work_dir, block_size=block_size, dflash_layers=dflash_layers,
                  base=base, markov_rank=markov_rank, lr_decay=lr_decay, device=resolved.type,
                  gen_prompts=gen_prompts, n_seq=n_seq, greedy_share=greedy_share, heldout_gen=heldout_gen,
                  train=TrainConfig(ttt_steps=ttt_steps, lr=lr, eval_every=eval_every, warmup_steps=warmup_steps,
                                    decay_shape=decay_shape))
    with _TrainProgress() as bar:
        summary = run(job, note=ui.status, progress=bar.extract, on_step=bar.step)
    end = summary["end"]
    acc = " ".join(f"{a:.2f}" for a in end["acceptance"]) if end else "n/a"
    tau = f" (τ ≈ {end['tau']:.2f})" if end else ""
    ui.status(f"wrote {summary['out']} after {summary['steps']} steps ({summary['seconds']:.0f} s, "
              f"{summary['tokens']} tokens on {resolved.type}); held-out top-1 acceptance by position: "
              f"{acc}{tau}")
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
