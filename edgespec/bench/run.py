"""`edgespec bench`: plain decoding vs speculative configs, alternating on the same backend.

For every task and repeat the order is plain, config₁, plain, config₂, …: each speculative run is
paired with the plain run just before it, so machine drift hits both sides of a ratio alike. A
session (bench/sessions) runs turn by turn the same way, per config: plain t1, spec t1, plain t2,
spec t2, …, its drafter cleared at the session's start only.
"""

from __future__ import annotations

import platform
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from edgespec.bench.profile import ideal_speedup_at
from edgespec.bench.provenance import provenance
from edgespec.bench.sessions import Session, as_session
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
        name = ",".join(part.rsplit("/", 1)[-1] for part in self.drafter.split(","))  # file names, not paths
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
    turn: int = 1  # the turn of its session (a single-shot task: 1)
    by_member: dict[str, int] = field(default_factory=dict)  # a chain: cycles verified per member


def run_matrix(engine: Engine, drafters: dict[str, object], configs: Sequence[Config],
               tasks: Sequence[Task | Session], temperatures: Sequence[float], repeats: int, chat: bool,
               on_run: Callable[[Run], None] | None = None, plain_engine: Engine | None = None) -> list[Run]:
    """Run every task (or session) × temperature × repeat × config and return all runs: per turn (a
    single-shot task is a session of one turn) a plain run, then the config's speculative run.
    `drafters` maps Config.drafter to a loaded drafter; the engine's drafter is swapped per config and
    starts cold at each session (`start_cold`), so a session's later turns draw on its earlier ones
    only. Plain runs use `plain_engine` when given (a target without feature capture), else `engine`."""
    runs: list[Run] = []
    for session in map(as_session, tasks):
        for temp in temperatures:
            for rep in range(repeats):
                for cfg in configs:
                    engine.drafter = drafters[cfg.drafter]
                    start_cold(engine.drafter)
                    for k, turn in enumerate(session.turns, 1):
                        for r in _pair(engine, plain_engine or engine, turn, k, cfg, temp, rep, chat):
                            runs.append(r)
                            if on_run:
                                on_run(r)
    return runs


def start_cold(drafter: object) -> None:
    """Make `drafter` forget every earlier generation: the one place the bench does. A drafter that
    remembers across generations (HistoryDrafter: earlier contexts in its index) exposes `clear()`;
    those that look at the current context only (ngram, a draft model, heads: their caches resync by
    common prefix) have none. The scheduler's record of the pair (Pricing) is kept, as in a server."""
    clear = getattr(drafter, "clear", None)
    if clear is not None:
        clear()


def _pair(engine: Engine, plain_engine: Engine, turn: Task, k: int, cfg: Config, temp: float, rep: int,
          chat: bool) -> tuple[Run, Run]:
    """One turn decoded plainly, then speculatively with `cfg`: (plain run, speculative run)."""
    kw = dict(max_tokens=turn.max_tokens, temperature=temp, seed=1000 * rep + 1, num_draft=cfg.k)
    plain_gen, plain = run_one(plain_engine, turn, kw, chat, speculative=False)
    spec_gen, spec = run_one(engine, turn, kw, chat, speculative=True)
    p, s = _record(turn, "plain", temp, rep, k, plain), _record(turn, cfg.label, temp, rep, k, spec)
    s.plain_tok_per_s = plain.tok_per_s
    s.matches_plain = spec_gen.tokens == plain_gen.tokens if temp == 0 else None
    return p, s


def run_one(engine: Engine, task: Task, kw: dict, chat: bool, speculative: bool) -> tuple[Generation, Stats]:
    """One generation of `task` from a cold cache (chat template when `chat`), with `kw` as for
    Engine.generate; returns it and its stats."""
    engine.reset()  # every run pays its own prompt: no cache carried between configs or turns
    gen = (engine.chat(list(task.messages), speculative=speculative, **kw) if chat
           else engine.generate(task.prompt, speculative=speculative, **kw))
    return gen, gen.stats


def _record(task: Task, label: str, temp: float, rep: int, turn: int, s: Stats) -> Run:
    return Run(task.id, task.category, label, temp, rep, s.tok_per_s, s.n_tokens, s.tau,
               s.t_draft, s.t_verify, s.t_other, s.peak_rss_mb, list(s.cycles), turn=turn,
               by_member=dict(s.by_member))


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
        by_member = Counter[str]()
        for r in rs:
            by_member.update(r.by_member)
        if by_member:
            row["by_member"] = dict(by_member)
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


def by_turn(runs: Sequence[Run]) -> list[dict]:
    """Per (config, temperature, turn k of the sessions): n, median speedup and τ over the k-th turns,
    i.e. how speculation fares as a session's history grows; [] when no run is past a first turn
    (single-shot tasks)."""
    if all(r.turn == 1 for r in runs):
        return []
    groups: dict[tuple[str, float, int], list[Run]] = {}
    for r in runs:
        if r.config != "plain" and r.plain_tok_per_s:
            groups.setdefault((r.config, r.temperature, r.turn), []).append(r)
    return [dict(config=config, temperature=temp, turn=turn, n=len(rs),
                 speedup_median=statistics.median(r.tok_per_s / r.plain_tok_per_s for r in rs),
                 tau=sum(r.n_tokens for r in rs) / max(1, sum(len(r.cycles) for r in rs)))
            for (config, temp, turn), rs in sorted(groups.items())]


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
    """The software and machine of a bench run: versions, platform, and its provenance (commit, date,
    CPU model: edgespec.bench.provenance)."""
    import llama_cpp
    import numpy

    import edgespec

    return dict(python=sys.version.split()[0], platform=platform.platform(), machine=platform.machine(),
                processor=platform.processor(), edgespec=edgespec.__version__, llama_cpp=llama_cpp.__version__,
                numpy=numpy.__version__, **provenance())


def runs_as_dicts(runs: Sequence[Run]) -> list[dict]:
    return [asdict(r) for r in runs]
