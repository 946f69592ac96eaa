"""`edgespec bench`: plain decoding vs speculative configs, alternating on the same backend.

For every task and repeat the order is plain, config₁, plain, config₂, …: each speculative run is
paired with the plain run just before it, so machine drift hits both sides of a ratio alike.
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from edgespec.bench.profile import ideal_speedup_at
from edgespec.bench.tasks import Task
from edgespec.drafters.base import DraftCost
from edgespec.engine import Engine
from edgespec.generation import Generation
from edgespec.stats import Stats


@dataclass(frozen=True)
class Config:
    drafter: str  # "ngram", a GGUF path or model name
    k: int | str  # γ, or "auto" (the scheduler)

    @property
    def label(self) -> str:
        name = self.drafter if self.drafter == "ngram" or "/" not in self.drafter else self.drafter.rsplit("/", 1)[1]
        return f"{name} k={self.k}"


def is_fixed_gamma(label: str) -> bool:
    """Whether a config label is a fixed γ ≥ 1 (not `k=auto`, nor the `k=0` A/A control)."""
    return not label.endswith(("k=auto", "k=0"))


@dataclass
class Run:
    task: str
    category: str
    config: str  # Config.label, or "plain"
    temperature: float
    repeat: int
    tok_per_s: float
    n_tokens: int
    tau: float
    t_draft: float
    t_verify: float
    t_other: float
    peak_rss_mb: float
    cycles: list[tuple[int, int]] = field(default_factory=list)
    plain_tok_per_s: float | None = None  # the paired plain run's speed
    matches_plain: bool | None = None  # greedy only: spec tokens == plain tokens


def run_matrix(engine: Engine, drafters: dict[str, object], configs: Sequence[Config], tasks: Sequence[Task],
               temperatures: Sequence[float], repeats: int, chat: bool,
               on_run: Callable[[Run], None] | None = None, plain_engine: Engine | None = None) -> list[Run]:
    """Run every task × temperature × repeat as plain, config, plain, config, … and return all runs.
    `drafters` maps Config.drafter to a loaded drafter; the engine's drafter is swapped per config.
    Plain runs use `plain_engine` when given (a target without feature capture), else `engine`."""
    runs: list[Run] = []
    for task in tasks:
        for temp in temperatures:
            for rep in range(repeats):
                for cfg in configs:
                    kw = dict(max_tokens=task.max_tokens, temperature=temp, seed=1000 * rep + 1, num_draft=cfg.k)
                    plain = run_one(plain_engine or engine, task, kw, chat, speculative=False)
                    engine.drafter = drafters[cfg.drafter]
                    spec = run_one(engine, task, kw, chat, speculative=True)
                    for label, (gen, stats) in (("plain", plain), (cfg.label, spec)):
                        r = _record(task, label, temp, rep, stats)
                        if label != "plain":
                            r.plain_tok_per_s = plain[1].tok_per_s
                            r.matches_plain = gen.tokens == plain[0].tokens if temp == 0 else None
                        runs.append(r)
                        if on_run:
                            on_run(r)
    return runs


def run_one(engine: Engine, task: Task, kw: dict, chat: bool, speculative: bool) -> tuple[Generation, Stats]:
    """One generation of `task` from a cold cache (chat template when `chat`), with `kw` as for
    Engine.generate; returns it and its stats."""
    engine.reset()  # every run pays its own prompt: no cache carried between configs
    gen = (engine.chat(list(task.messages), speculative=speculative, **kw) if chat
           else engine.generate(task.prompt, speculative=speculative, **kw))
    return gen, gen.stats


def _record(task: Task, label: str, temp: float, rep: int, s: Stats) -> Run:
    return Run(task.id, task.category, label, temp, rep, s.tok_per_s, s.n_tokens, s.tau,
               s.t_draft, s.t_verify, s.t_other, s.peak_rss_mb, list(s.cycles))


def summarize(runs: Sequence[Run], t_forward_ms: dict[int, float] | None = None,
              draft_cost: dict[str, DraftCost] | None = None) -> list[dict]:
    """Per (config, temperature, category) and per (config, temperature, "all"): medians and ratios."""
    groups: dict[tuple[str, float, str], list[Run]] = {}
    for r in runs:
        if r.config == "plain":
            continue
        for cat in (r.category, "all"):
            groups.setdefault((r.config, r.temperature, cat), []).append(r)
    rows = []
    for (config, temp, cat), rs in sorted(groups.items()):
        ratios = sorted(r.tok_per_s / r.plain_tok_per_s for r in rs if r.plain_tok_per_s)
        t_total = sum(r.t_draft + r.t_verify + r.t_other for r in rs) or 1.0
        row = dict(config=config, temperature=temp, category=cat, n=len(rs),
                   tok_per_s=statistics.median(r.tok_per_s for r in rs),
                   plain_tok_per_s=statistics.median(r.plain_tok_per_s for r in rs if r.plain_tok_per_s),
                   speedup_min=ratios[0], speedup_median=statistics.median(ratios), speedup_max=ratios[-1],
                   tau=sum(r.n_tokens for r in rs) / max(1, sum(len(r.cycles) for r in rs)),
                   wasted_per_token=wasted_per_token(rs),
                   acceptance_by_position=acceptance_by_position([c for r in rs for c in r.cycles]),
                   split={"draft": sum(r.t_draft for r in rs) / t_total, "verify": sum(r.t_verify for r in rs) / t_total,
                          "other": sum(r.t_other for r in rs) / t_total},
                   peak_rss_mb=max(r.peak_rss_mb for r in rs),
                   mismatches=sum(1 for r in rs if r.matches_plain is False))
        row.update(memory_bound_prediction(rs))
        if t_forward_ms:
            cost = (draft_cost or {}).get(config)  # None: drafting is free (n-gram)
            row["ideal_speedup"] = ideal_speedup_at(
                t_forward_ms, lambda d, c=cost: c.fixed_ms + d * c.per_token_ms if c and d else 0.0,
                [c for r in rs for c in r.cycles])
            row["efficiency"] = row["speedup_median"] / row["ideal_speedup"] if row["ideal_speedup"] else None
        rows.append(row)
    return rows


def memory_bound_prediction(rs: Sequence[Run]) -> dict:
    """A PREDICTION, not a measurement: the speedup these very cycles would give where verifying up to
    9 tokens costs one step (T(k) = T(1), memory-bound batch-1 decoding on a GPU or Apple silicon),
    with the draft cost per token in units of T(1) as measured here (the drafter's ms per drafted token
    in these runs ÷ the plain runs' median ms per token): Σ tokens / Σ (1 + d·c) over cycles (d, n)."""
    cycles = [c for r in rs for c in r.cycles]
    drafted = sum(d for d, _ in cycles)
    plain = [r.plain_tok_per_s for r in rs if r.plain_tok_per_s]
    if not cycles or not plain:
        return {}
    t1_ms = 1000.0 / statistics.median(plain)
    draft_ms = 1000.0 * sum(r.t_draft for r in rs) / drafted if drafted else 0.0
    c = draft_ms / t1_ms
    tokens = sum(min(n, d) + 1 for d, n in cycles)
    return {"draft_ms_per_token": draft_ms, "draft_cost_vs_t1": c,
            "predicted_memory_bound": tokens / sum(1 + d * c for d, _ in cycles)}


def wasted_per_token(rs: Sequence[Run]) -> float:
    """Rejected draft positions sent to verification per generated token, over runs (the first
    rejected position of a cycle and every one after it: drafted − accepted)."""
    return sum(d - n for r in rs for d, n in r.cycles) / max(1, sum(r.n_tokens for r in rs))


def acceptance_by_position(cycles: Sequence[tuple[int, int]]) -> list[float | None]:
    """P(draft position i is accepted | it was drafted and positions before it were accepted);
    None where no cycle reached position i."""
    out: list[float | None] = []
    for i in range(max((d for d, _ in cycles), default=0)):
        reached = sum(1 for d, n in cycles if d > i and n >= i)
        out.append(sum(1 for _, n in cycles if n > i) / reached if reached else None)
    return out


def environment() -> dict:
    import llama_cpp
    import numpy

    import edgespec

    return dict(python=sys.version.split()[0], platform=platform.platform(), machine=platform.machine(),
                processor=platform.processor(), edgespec=edgespec.__version__, llama_cpp=llama_cpp.__version__,
                numpy=numpy.__version__, date=time.strftime("%Y-%m-%d %H:%M:%S"))


def runs_as_dicts(runs: Sequence[Run]) -> list[dict]:
    return [asdict(r) for r in runs]
