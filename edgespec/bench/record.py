"""Record drafter traces (edgespec.bench.trace) of every drafter kind: what a drafter proposes at
every position of the target's output, for exact replays under any policy and any device's costs.

`Recorder` is a scheduler for `Engine.stream(scheduler=...)` that verifies nothing: at every cycle
it asks each drafter for its longest draft (`longest`: 31 for a free copying drafter, ngram and
history; 15, the scheduler's COSTLY_GAMMA, for the others) from the true context, with the
drafter's own rng (`np.random.default_rng(seed)`: the target's draws never depend on which drafter
is recorded), times it, keeps its tokens, confidences, support and ms, and returns an empty draft,
so the engine takes a plain step: the output is plain decoding's, and every drafter of a task
shares it. Drafts are discarded, as the scheduler's shadow drafts are (a draft model, a head
resyncs to the context at each call). Sampled, the target's processed row p at each position gives
accept[p] = Σ min(p, q₀) with q₀ the draft's first row, or p(x̃₁) for a one-hot draft (0: no draft).
With `tree_nodes`, a tree drafter drafts its tree instead (its first-child chain is the draft): greedy
any tree drafter; sampled, one whose trees `--tree auto` cuts (drafters.base.prices_sampled_trees),
its side trees kept with each root child's exact chance of acceptance (`root_chances`).
Each generation asks the engine for one token more than the task's budget, so the budget's last
position has its draft too (the engine drafts nothing for the last token it may emit), and a task's
drafters start cold (bench.run.start_cold: the history drafter forgets earlier tasks). A drafter
that tracks its own recent hits (history's length cap) is scored at every position here, not only
at the positions a real run drafts from.

`record()` opens the target with the drafter (a chain: one TraceSet per member, same outputs),
calibrates the target (T(k)) and fits each member's drafting cost, fixed + γ · per_token ms, by
least squares through its (draft length, ms) pairs (each task's first draft, which reads the
prompt, left out), or takes its `cost_prior()` when every draft had the same length.

    .venv/bin/python -m edgespec.bench.record --target smollm2-f32 --drafter ngram --drafter smollm2 \\
        --per-category 2 --max-tokens 96 --temp 0 --temp 0.7 --out out/traces

writes out/traces/<drafter>-t<temp>.json.gz per drafter (chain member) and temperature.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from edgespec.bench.provenance import commit, cpu_model
from edgespec.bench.trace import Trace, TraceSet
from edgespec.drafters.base import Draft, DraftCost, Drafter, can_draft_trees, prices_sampled_trees
from edgespec.sampling import Dist, SamplingParams
from edgespec.schedule.rate import Decision
from edgespec.schedule.scheduler import COSTLY_GAMMA, K_MAX
from edgespec.schedule.trees import TreeDrafting
from edgespec.tree import DraftTree, without

FREE_KINDS = ("ngram", "history")  # drafting costs next to nothing: they are recorded to K_MAX − 1
Note = Callable[[str], None]


def default_longest(kind: str) -> int:
    """The longest draft recorded for a drafter of this kind (what the scheduler may verify)."""
    return K_MAX - 1 if kind in FREE_KINDS else COSTLY_GAMMA


@dataclass
class _Track:
    """One drafter's per-position record in the current generation."""

    drafts: list[list[int]] = field(default_factory=list)
    confidence: list[list[float] | None] = field(default_factory=list)
    support: list[int | None] = field(default_factory=list)
    ms: list[float] = field(default_factory=list)
    accept: list[float] = field(default_factory=list)
    trees: list[list[list]] = field(default_factory=list)
    tree_accept: list[list[float]] = field(default_factory=list)
    side_trees: bool = True  # sampled: every tree drafted was a side tree (else none is kept)


class Recorder:
    """A scheduler (engine.Scheduling) that drafts with every drafter at every position, records,
    and verifies nothing (see the module docstring)."""

    def __init__(self, drafters: Sequence[Drafter], longest: Sequence[int], seed: int = 0, tree_nodes: int = 0) -> None:
        self.drafters, self.longest, self.seed, self.tree_nodes = list(drafters), list(longest), seed, tree_nodes
        self.new_generation(0)

    def new_generation(self, n_prompt: int, max_tokens: int | None = None) -> None:
        self.n_prompt, self.sampled = n_prompt, False
        self.rngs = [np.random.default_rng(self.seed) for _ in self.drafters]
        self.tracks = [_Track() for _ in self.drafters]
        self.output: list[int] = []  # every token emitted (an end-of-text one included)
        self._first: list[tuple[int, np.ndarray | None] | None] = []  # per drafter: (x̃₁, q₀) at this position
        self._trees: list[DraftTree | None] = []  # per drafter: its sampled tree at this position

    def draft(self, drafter: Drafter, context: Sequence[int], limit: int, params: SamplingParams,
              rng: np.random.Generator) -> tuple[Draft, Decision]:
        if len(context) - self.n_prompt != len(self.output):
            raise RuntimeError(f"recording: a draft after {len(context)} tokens, expected after "
                               f"{self.n_prompt} + {len(self.output)}")
        self.sampled = not params.greedy
        self._first, self._trees = [], []
        for d, longest, own, track in zip(self.drafters, self.longest, self.rngs, self.tracks):
            t0 = time.perf_counter()
            tree = None
            if self.tree_nodes and (can_draft_trees(d) if params.greedy else prices_sampled_trees(d)):
                # the tree's first-child chain is the draft
                tree = d.draft_tree(context, self.tree_nodes, longest, params, own)  # type: ignore[attr-defined]
                conf = tree.confidence or [0.5] * tree.n_nodes
                if self.sampled:  # each node's probability in its row (q None: one-hot, 1)
                    track.side_trees &= tree.side_leaves
                    conf = [1.0 if tree.q is None else float(tree.q[i][t]) for i, t in enumerate(tree.tokens)]
                track.trees.append([tree.tokens, tree.parents, [round(float(c), 4) for c in conf]])
                made = TreeDrafting.from_tree(tree)
            else:
                made = d.draft(context, longest, params, own)
            track.ms.append(round(1000 * (time.perf_counter() - t0), 4))
            tokens = [int(x) for x in made.tokens[:longest]]
            track.drafts.append(tokens)
            conf = made.confidence
            track.confidence.append(None if conf is None else [round(float(c), 4) for c in conf[:len(tokens)]])
            track.support.append(made.support)
            self._first.append((tokens[0], None if made.q is None else made.q[0]) if tokens else None)
            self._trees.append(tree)
        return Draft([]), Decision()

    def observe(self, draft: Draft, accepted: int, t_draft: float, t_verify: float,
                context: int | None = None, rollback: float = 0.0) -> None:
        pass  # nothing is verified

    def emitted(self, tokens: Sequence[int], probs: Sequence[Dist] | None = None) -> None:
        for j, tok in enumerate(tokens):
            if self.sampled and probs is not None and j == 0:
                for track, first, tree in zip(self.tracks, self._first, self._trees):
                    if len(track.accept) == len(self.output) < len(track.drafts):
                        track.accept.append(round(accept(probs[j], first), 5))
                        if tree is not None:
                            track.tree_accept.append([round(a, 5) for a in root_chances(probs[j], tree)])
            self.output.append(int(tok))
            self._first, self._trees = [], []

    def trace(self, i: int, task: str, category: str, max_tokens: int, is_eog: Callable[[int], bool]) -> Trace:
        """Drafter i's Trace of the generation just ended, cut to `max_tokens` or its first end of text."""
        end = next((k for k, t in enumerate(self.output) if is_eog(t)), None)
        eos = end is not None and end < max_tokens
        n = end + 1 if eos else min(len(self.output), max_tokens)
        t = self.tracks[i]
        if len(t.drafts) < n:
            raise RuntimeError(f"recording {task}: {len(t.drafts)} drafts for {n} positions")
        conf = None if all(c is None for c in t.confidence[:n]) else [c or [] for c in t.confidence[:n]]
        support = None if all(s is None for s in t.support[:n]) else t.support[:n]
        trees = t.trees[:n] if t.trees and (t.side_trees or not self.sampled) else None
        return Trace(task, category, self.n_prompt, self.output[:n], eos, max_tokens, t.drafts[:n], conf,
                     support, t.accept[:n] if self.sampled else None, t.ms[:n], trees,
                     t.tree_accept[:n] if trees and self.sampled else None)


def accept(p: Dist, first: tuple[int, np.ndarray | None] | None) -> float:
    """The chance verification accepts a draft's first token: Σ min(p, q₀), or p(x̃₁) for a one-hot
    q (q₀ None); 0 for no draft."""
    if first is None:
        return 0.0
    x, q0 = first
    if q0 is None:
        return float(p[x])
    dense = p.dense()
    n = min(len(dense), len(q0))
    return float(np.minimum(dense[:n], q0[:n]).sum())


def root_chances(p: Dist, tree: DraftTree) -> list[float]:
    """The chance recursive rejection sampling (tree.verify_tree_stochastic) accepts each of the
    root's children of `tree` given the ones before it were rejected, `p` the target's processed row:
    min(1, r(x)/q_j(x)) with r the residual left by the earlier ones and q_j the child's row less the
    earlier siblings' tokens (one-hot for deterministic drafts)."""
    r, out, kids = p.dense().astype(np.float64), [], tree.children(-1)
    for j, c in enumerate(kids):
        x = tree.tokens[c]
        if tree.q is None:
            q_j = np.zeros_like(r)
            q_j[x] = 1.0
        else:
            q_j = without(tree.q[c], [tree.tokens[s] for s in kids[:j]])[:len(r)]
        out.append(min(1.0, float(r[x] / q_j[x])) if q_j[x] > 0 else 0.0)
        nxt = np.maximum(r - q_j, 0.0)
        if nxt.sum() <= 0.0:  # nothing left to reject into: the later ones are never tried
            return out + [0.0] * (len(kids) - j - 1)
        r = nxt / nxt.sum()
    return out


def record_tasks(engine, drafters: Sequence[Drafter], tasks: Sequence, temperature: float,
                 longest: Sequence[int], seed: int = 0, chat: bool = False,
                 note: Note | None = None, tree_nodes: int = 0) -> list[list[Trace]]:
    """Per drafter, its Trace of each task (bench Tasks: `messages` with the chat template when
    `chat`, else `prompt`; each capped at its max_tokens); task n samples with seed + n."""
    from edgespec.bench.run import run_one, start_cold

    out: list[list[Trace]] = [[] for _ in drafters]
    for n, task in enumerate(tasks):
        for d in drafters:
            start_cold(d)
        rec = Recorder(drafters, longest, seed + n, tree_nodes)
        kw = dict(max_tokens=task.max_tokens + 1, temperature=temperature, seed=seed + n, num_draft="auto",
                  scheduler=rec)
        t0 = time.perf_counter()
        run_one(engine, task, kw, chat, speculative=True)
        for i, traces in enumerate(out):
            traces.append(rec.trace(i, task.id, task.category, task.max_tokens, engine.target.is_eog))
        if note:
            note(f"{task.id} (T {temperature:g}): {len(out[0][-1].output)} tokens, "
                 f"{time.perf_counter() - t0:.1f} s")
    return out


def fit_cost(traces: Sequence[Trace], prior: DraftCost | None) -> tuple[float, float]:
    """(fixed_ms, per_token_ms) through the recorded (draft length, ms) pairs with a draft, each
    trace's first left out (it reads the prompt); `prior` when every draft had the same length."""
    pairs = [(len(d), ms) for t in traces for p, (d, ms) in enumerate(zip(t.drafts, t.draft_ms or ())) if p and d]
    if len({n for n, _ in pairs}) >= 2:
        slope, fixed = np.polyfit(*zip(*pairs), 1)
        return round(max(0.0, float(fixed)), 4), round(max(0.0, float(slope)), 4)
    if prior is not None:
        return prior.fixed_ms, prior.per_token_ms
    return (round(float(np.median([ms for _, ms in pairs])), 4) if pairs else 0.0), 0.0


def record(target: str, drafter: str, prompts: Sequence, temperature: float, longest: int | None = None,
           max_tokens: int | None = None, seed: int = 0, threads: int | None = None, n_ctx: int = 2048,
           note: Note | None = None, tree_nodes: int = 0) -> list[TraceSet]:
    """The TraceSet of `drafter` (a chain: one per member, sharing outputs) over `prompts` (bench
    Tasks, each capped at `max_tokens`) on `target` at `temperature`, drafting up to `longest`
    (None: `default_longest` of each member's kind); a tree drafter's trees of up to `tree_nodes`
    nodes (0: none) at every position too (the module docstring)."""
    from edgespec.bench.sessions import cap_tokens
    from edgespec.session import Session, plan

    tasks = [cap_tokens(t, max_tokens) for t in prompts]
    with Session(plan(target, drafter, threads=threads, n_ctx=n_ctx)) as session:
        engine = session.engine
        parts = session.plan.drafters[0].parts
        drafters = list(getattr(engine.drafter, "members", None) or [engine.drafter])
        engine.calibrate(note=note)
        assert engine.costs is not None and len(drafters) == len(parts)
        chat = engine.target.metadata("tokenizer.chat_template") is not None
        lengths = [longest or default_longest(p.kind) for p in parts]
        for i, d in enumerate(drafters):  # a block drafter drafts at most its block (DFlash: B − 1)
            cost = engine.pricing.draft_cost.get(d)
            lengths[i] = min(lengths[i], cost.max_block or lengths[i]) if cost is not None else lengths[i]
        traced = record_tasks(engine, drafters, tasks, temperature, lengths, seed, chat, note, tree_nodes)
        today, at, sha = datetime.date.today().isoformat(), cpu_model(), commit(Path(__file__).parent)
        sets = []
        for p, d, n, traces in zip(parts, drafters, lengths, traced):
            fixed, per_token = fit_cost(traces, engine.pricing.draft_cost.get(d))
            sets.append(TraceSet(Path(str(engine.target.path)).name, p.spec, p.kind, temperature, n,
                                 dict(engine.costs.t_forward_ms), fixed, per_token, at, sha, today, traces))
    return sets


def file_name(spec: str, temperature: float) -> str:
    """<drafter>-t<temp>.json.gz: a path's file name without .gguf, other characters made safe."""
    name = re.sub(r"\.gguf$", "", Path(spec).name) if ("/" in spec or spec.endswith(".gguf")) else spec
    return f"{re.sub(r'[^A-Za-z0-9._-]+', '-', name)}-t{temperature:g}.json.gz"


def select(suite: str, prompts: str | None, per_category: int) -> list:
    """The bench's tasks: `prompts` (a bench JSONL file or folder) or a built-in suite, per category."""
    from edgespec.bench.tasks import first_per_category, load_tasks

    if prompts is not None:
        chosen = load_tasks(prompts)
    elif suite == "spec-bench":
        from edgespec.bench.spec_bench import load_spec_bench

        chosen = load_spec_bench(None, per_category)
    else:
        chosen = load_tasks()
    return first_per_category(chosen, per_category)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--drafter", action="append", required=True, help="drafter spec (repeatable; a chain "
                    "records each member)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompts", help="a bench task file (JSONL) or folder instead of --suite")
    src.add_argument("--suite", choices=("shipped", "spec-bench"), default="shipped")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temp", type=float, action="append", help="temperature (repeatable; default 0)")
    ap.add_argument("--longest", type=int, help="longest draft recorded (default: 31 ngram/history, 15 others)")
    ap.add_argument("--seed", type=int, default=0, help="task n samples (target and drafter) with seed + n")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--tree-nodes", type=int, default=0, help="also record each tree drafter's draft tree of up "
                    "to this many nodes at every position (its first-child chain is the draft; T > 0: side trees "
                    "only, with each root child's chance of acceptance)")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=Path("out/traces"))
    args = ap.parse_args(argv)

    def note(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    tasks = select(args.suite, args.prompts, args.per_category)
    for spec in args.drafter:
        for temp in args.temp or [0.0]:
            note(f"recording {spec} on {args.target} at T {temp:g}: {len(tasks)} tasks")
            for s in record(args.target, spec, tasks, temp, args.longest, args.max_tokens, args.seed,
                            args.threads, args.ctx, note, args.tree_nodes):
                path = s.save(args.out / file_name(s.drafter, temp))
                note(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB, "
                     f"{sum(len(t.output) for t in s.traces)} tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
