"""Replay recorded drafter traces (edgespec.bench.trace) under every policy on every device's costs.

A trace holds, for one task, the target's output and the draft the drafter proposes at every position
from the true context. A cycle at position p verifies γ of that draft. Greedy: the accepted drafts are
exactly the draft's match with output[p:]. T > 0: drafted position i is accepted with probability
accept[p + i] (one uniform per position from a fixed-seed rng, shared by every policy), up to the first
reject: an approximation (the real draft at p + i would follow sampled, not recorded, tokens). A cycle
costs the drafting the drafter did (all it computed, even what is then cut: a free drafter's 31-token
shadow draft included) plus T(γ + 1, context), T(k, c) = T(k) + k · ctx · (c − 64) with the device's
T(k) and ctx_us; plain decoding costs T(1, c) per token. Speedup = plain time / the policy's time.

Policies: `auto` (the real Scheduler, ChainScheduler for chains, built from the device's costs, fed
the modeled times in seconds as the engine feeds it, one per trace set: what it learns carries over
tasks, `new_generation` per task); every fixed γ (1..15, 1..31 for a copying drafter) and `best-fixed`
(the best over the whole set, what MTPLX `tune` picks); the controllers of edgespec.bench.policies
(llama.cpp, transformers, ik_llama.cpp, BeeLlama); `oracle`, the best γ per cycle knowing the output
(a dynamic program; at T > 0 over the expected accepted length from accept[]), the ceiling. Chains
(a copying and a costly drafter of one target and temperature) get `auto` and `oracle` only.
At T > 0 `emitted()` gets probs=None: a shadow token is credited when the sampled output equals it,
whose mean for a copying drafter (one-hot q) is p(x̃), the credit the engine's probs give; only free
drafters are scored in shadow.

    .venv/bin/python -m edgespec.bench.replay --traces tests/fixtures/traces --device all    # make replay

Ends with one line: REPLAY traces=<trace sets> devices=<devices> auto_min_task=… auto_min_category=…
auto_vs_best_fixed_median=… auto_vs_best_controller_median=… auto_vs_oracle_median=… (medians over
(device, trace set) cells of the whole-set speedup ratios). `check` is the regression gate
(tests/test_replay_gate.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgespec.bench import policies as pol
from edgespec.bench.trace import Trace, TraceSet
from edgespec.drafters.base import Draft, DraftCost
from edgespec.sampling import SamplingParams
from edgespec.schedule import ChainScheduler, CostModel, Scheduler
from edgespec.schedule.costs import K_MAX

BASE_CONTEXT = 64  # the context T(k) is profiled after (edgespec.calibration.CONTEXT_TOKENS)
CONTROLLERS = ("llama.cpp", "hf-heuristic", "ik-autotune", "bee-profit")
SHOWN_FIXED = (1, 2, 4, 8, 15, 31)


class Costs:
    """A device's true costs for one drafter kind (device: edgespec.bench.devices.Device)."""

    def __init__(self, device: Any, kind: str) -> None:
        self.device, self.kind = device, kind
        self.t = list(device.t_ms)
        self.ctx_ms = device.ctx_us / 1000.0

    def verify(self, k: int, context: int) -> float:
        return self.t[k] + k * self.ctx_ms * max(0, context - BASE_CONTEXT)

    def draft(self, n: int) -> float:
        return self.device.draft_ms(self.kind, n) if n > 0 else 0.0

    def prior(self) -> DraftCost | None:
        fixed, per_token = (x * self.t[1] for x in self.device.draft[self.kind])
        if fixed <= 0 and per_token <= 0:
            return None
        return DraftCost(fixed, per_token, block=per_token <= 0)

    def model(self) -> CostModel:
        """The scheduler's starting cost model, as the engine's Pricing builds it."""
        return CostModel.for_drafter({k: self.t[k] for k in range(1, len(self.t))}, self.prior(),
                                     ctx_ms=self.ctx_ms, base_context=BASE_CONTEXT)


@dataclass
class Task:
    """One trace made ready to replay: per position the draft on offer and how much of it passes."""

    trace: Trace
    offer: list[int]  # draft length recorded at p (≤ K_MAX − 1)
    run: list[int]  # drafts that pass if verified (≤ offer, ≤ tokens left after p's own)
    accept: list[float] | None  # T > 0: P(first draft token accepted) per position


def prepare(trace: Trace, temperature: float, seed: int = 0) -> Task:
    n, out = len(trace.output), trace.output
    offer = [min(len(d), K_MAX - 1) for d in trace.drafts]
    if temperature == 0 or trace.accept is None:
        run = []
        for p, d in enumerate(trace.drafts):
            m, most = 0, min(offer[p], n - p - 1)
            while m < most and d[m] == out[p + m]:
                m += 1
            run.append(m)
        return Task(trace, offer, run, None)
    u = np.random.default_rng([seed, *map(ord, trace.task)]).random(n)
    ok = [float(x) < a for x, a in zip(u, trace.accept)]
    streak, following = [0] * (n + 1), 0
    for p in range(n - 1, -1, -1):
        following = following + 1 if ok[p] else 0
        streak[p] = following
    run = [min(offer[p], streak[p], n - p - 1) for p in range(n)]
    return Task(trace, offer, run, list(trace.accept))


@dataclass
class Result:
    task: str
    category: str
    ms: float
    plain_ms: float
    tokens: int
    cycles: float

    @property
    def speedup(self) -> float:
        return self.plain_ms / self.ms


def plain_ms(task: Task, c: Costs) -> float:
    ctx0 = task.trace.prompt_len - 1
    return sum(c.verify(1, ctx0 + p) for p in range(len(task.trace.output)))


def _limit(trace: Trace, p: int) -> int:
    return max(0, min(K_MAX - 1, trace.max_tokens - p - 1))  # as the engine asks


def run_controller(task: Task, c: Costs, ctrl: pol.Controller) -> Result:
    """One task under a draft-length controller (fixed γ, an engine's heuristic)."""
    tr, ms, cycles, p = task.trace, 0.0, 0, 0
    n, ctx0 = len(tr.output), tr.prompt_len - 1
    ctrl.start()
    if type(ctrl) is pol.Fixed:  # the fast path: no confidences, no feedback
        while p < n:
            g = min(ctrl.gamma, _limit(tr, p), task.offer[p])
            ms, cycles, p = ms + c.draft(g) + c.verify(g + 1, ctx0 + p), cycles + 1, p + min(g, task.run[p]) + 1
        return Result(tr.task, tr.category, ms, plain_ms(task, c), n, cycles)
    while p < n:
        limit = _limit(tr, p)
        k = min(ctrl.ask(limit), limit, task.offer[p]) if limit else 0
        conf = tr.confidence[p][:k] if tr.confidence is not None and tr.confidence[p] is not None else None
        computed, g = ctrl.keep(conf, k) if k else (0, 0)
        acc = min(g, task.run[p])
        t_draft = c.draft(computed)
        cycle = t_draft + c.verify(g + 1, ctx0 + p)
        ctrl.feedback(g, acc, cycle, t_draft)
        ms, cycles, p = ms + cycle, cycles + 1, p + acc + 1
    return Result(tr.task, tr.category, ms, plain_ms(task, c), n, cycles)


def oracle(tasks: list[Task], costs: list[Costs]) -> Result:
    """The least time knowing the output: a dynamic program over positions choosing, at each, the
    member (a chain: any of `tasks`, one per member, same output) and γ; at T > 0 it minimises the
    expected time over the accept[] Bernoulli model."""
    tr = tasks[0].trace
    n, ctx0 = len(tr.output), tr.prompt_len - 1
    best, cyc = [0.0] * (n + 1), [0.0] * (n + 1)
    for p in range(n - 1, -1, -1):
        b, bc = costs[0].verify(1, ctx0 + p) + best[p + 1], 1 + cyc[p + 1]  # a plain step
        for task, c in zip(tasks, costs):
            most = min(task.offer[p], _limit(tr, p))
            if task.accept is None:
                for g in range(1, most + 1):
                    nxt = p + min(g, task.run[p]) + 1
                    v = c.draft(g) + c.verify(g + 1, ctx0 + p) + best[nxt]
                    if v < b:
                        b, bc = v, 1 + cyc[nxt]
                continue
            s, pre, pre_c = 1.0, 0.0, 0.0  # S_g, Σ_{j<g} (S_j − S_{j+1}) · best[p + j + 1]
            for g in range(1, most + 1):
                s_next = s * task.accept[p + g - 1] if g <= n - p - 1 else 0.0
                pre, pre_c = pre + (s - s_next) * best[p + g], pre_c + (s - s_next) * cyc[p + g]
                s = s_next
                nxt = min(n, p + g + 1)
                v = c.draft(g) + c.verify(g + 1, ctx0 + p) + pre + s * best[nxt]
                if v < b:
                    b, bc = v, 1 + pre_c + s * cyc[nxt]
        best[p], cyc[p] = b, bc
    return Result(tr.task, tr.category, best[0], plain_ms(tasks[0], costs[0]), n, cyc[0])


class TraceDrafter:
    """A Drafter that proposes what a trace recorded at the position the context has reached."""

    paths: tuple[str, ...] = ()

    def __init__(self, traces: TraceSet, costs: Costs) -> None:
        self.name, self.set, self.costs = traces.drafter, traces, costs
        self.sampled_q = traces.temperature > 0 and traces.kind not in pol.COPYING
        self.trace: Trace | None = None
        self.computed = 0  # tokens drafted since `computed` was last zeroed (a block: rows asked)

    def draft(self, context, gamma, params, rng, stop=None) -> Draft:
        tr = self.trace
        assert tr is not None
        p = len(context) - tr.prompt_len
        tokens = tr.drafts[p][:gamma]
        conf = tr.confidence[p][:len(tokens)] if tr.confidence is not None and tr.confidence[p] is not None else None
        if stop is not None and conf is not None:
            n = next((i for i in range(len(tokens)) if stop(conf[:i + 1])), len(tokens))
            tokens, conf = tokens[:n], conf[:n]
        self.computed += gamma if tokens and self.costs.device.draft[self.set.kind][1] <= 0 else len(tokens)
        q = np.zeros((len(tokens), 1)) if self.sampled_q and tokens else None  # sampled: not cut afterwards
        support = tr.support[p] if tr.support is not None else None
        return Draft(list(tokens), q, None if conf is None else list(conf), support=support)

    def cost_prior(self, note=None) -> DraftCost | None:
        return self.costs.prior()

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


def run_auto(members: list[tuple[TraceSet, list[Task]]], device: Any) -> list[Result]:
    """Every task of a trace set (a chain: of its members' sets, task by task) under `-k auto`."""
    costs = [Costs(device, ts.kind) for ts, _ in members]
    drafters = [TraceDrafter(ts, c) for (ts, _), c in zip(members, costs)]
    scheds = [Scheduler(c.model()) for c in costs]
    chain = ChainScheduler(list(zip(drafters, scheds))) if len(members) > 1 else None
    sched: Any = chain or scheds[0]
    temp = members[0][0].temperature
    params, rng = SamplingParams(temperature=temp), np.random.default_rng(0)
    out = []
    for i, task in enumerate(members[0][1]):
        tr = task.trace
        n, ctx0, ms, cycles, p = len(tr.output), tr.prompt_len - 1, 0.0, 0, 0
        for d, (_, tasks) in zip(drafters, members):
            d.trace = tasks[i].trace
        sched.new_generation(tr.prompt_len, tr.max_tokens)
        context = [0] * tr.prompt_len + tr.output  # a drafter reads only its length here
        while p < n:
            limit = _limit(tr, p)
            for d in drafters:
                d.computed = 0
            d_, dec = sched.draft(None if chain else drafters[0], context[:tr.prompt_len + p], limit, params, rng) \
                if limit else (Draft([]), None)
            g = len(d_.tokens)
            who = 0 if chain is None or chain.chosen is None else scheds.index(chain.chosen)
            acc = min(g, members[who][1][i].run[p])
            t_draft = sum(c.draft(d.computed) for c, d in zip(costs, drafters))
            t_verify = costs[0].verify(g + 1, ctx0 + p)
            sched.observe(d_, acc, t_draft / 1000, t_verify / 1000, ctx0 + p)
            sched.emitted(tr.output[p:p + acc + 1], None)
            ms, cycles, p = ms + t_draft + t_verify, cycles + 1, p + acc + 1
        out.append(Result(tr.task, tr.category, ms, plain_ms(task, costs[0]), n, cycles))
    return out


def controllers(kind: str, seed: int = 0) -> dict[str, pol.Controller]:
    free = kind in pol.COPYING
    return {"llama.cpp": pol.LlamaCpp(kind), "hf-heuristic": pol.HFHeuristic(),
            "ik-autotune": pol.IkAutotune(kind, seed=seed), "bee-profit": pol.BeeProfit(31 if free else 15)}


def fixed_range(kind: str) -> range:
    return range(1, (K_MAX if kind in pol.COPYING else 16))


def replay_set(ts: TraceSet, device: Any, seed: int = 0) -> dict[str, list[Result]]:
    """Every policy over one trace set on one device: {policy: per-task results}."""
    tasks = [prepare(t, ts.temperature, seed) for t in ts.traces]
    c = Costs(device, ts.kind)
    res = {"auto": run_auto([(ts, tasks)], device)}
    for g in fixed_range(ts.kind):
        res[f"k={g}"] = [run_controller(t, c, pol.Fixed(g)) for t in tasks]
    best = max((k for k in res if k.startswith("k=")), key=lambda k: total(res[k]))
    res["best-fixed"] = res[best]  # the same list: `best_gamma` finds which
    for name, ctrl in controllers(ts.kind, seed).items():
        res[name] = [run_controller(t, c, ctrl) for t in tasks]
    res["oracle"] = [oracle([t], [c]) for t in tasks]
    return res


def replay_chain(sets: list[TraceSet], device: Any, seed: int = 0) -> dict[str, list[Result]]:
    """A chain of trace sets (same target, temperature and tasks): auto and the oracle."""
    ids = set.intersection(*({t.task for t in ts.traces} for ts in sets))
    members = []
    for ts in sets:
        by_id = {t.task: t for t in ts.traces}
        members.append((ts, [prepare(by_id[i], ts.temperature, seed) for i in sorted(ids)]))
    keep = [j for j in range(len(ids)) if all(m[1][j].trace.output == members[0][1][j].trace.output for m in members)]
    members = [(ts, [tasks[j] for j in keep]) for ts, tasks in members]
    costs = [Costs(device, ts.kind) for ts in sets]
    return {"auto": run_auto(members, device),
            "oracle": [oracle([m[1][j] for m in members], costs) for j in range(len(keep))]}


def total(rs: list[Result]) -> float:
    return sum(r.plain_ms for r in rs) / sum(r.ms for r in rs) if rs else float("nan")


def tau(rs: list[Result]) -> float:
    return sum(r.tokens for r in rs) / sum(r.cycles for r in rs)


def by_category(rs: list[Result]) -> dict[str, list[Result]]:
    out: dict[str, list[Result]] = defaultdict(list)
    for r in rs:
        out[r.category].append(r)
    return out


def best_gamma(res: dict[str, list[Result]]) -> int:
    return next(int(k[2:]) for k, v in res.items() if k.startswith("k=") and v is res["best-fixed"])


def set_name(ts: TraceSet) -> str:
    return f"{ts.target}:{ts.drafter}:T{ts.temperature:g}"


def load_sets(path: str | Path) -> list[TraceSet]:
    path = Path(path)
    files = sorted(path.glob("*.json.gz")) if path.is_dir() else [path] if path.exists() else []
    return [TraceSet.load(f) for f in files]


def chains_of(sets: list[TraceSet]) -> list[list[TraceSet]]:
    """Every (copying drafter, costly drafter) pair of one target and temperature."""
    out = []
    for a in sets:
        for b in sets:
            if (a.kind in pol.COPYING and b.kind not in pol.COPYING and a.target == b.target
                    and a.temperature == b.temperature):
                out.append([a, b])
    return out


def replay_all(sets: list[TraceSet], devices: list[Any]) -> dict[str, dict[str, dict[str, list[Result]]]]:
    """{device: {set name: {policy: results}}}, chains included (names joined by ',')."""
    if len(devices) > 1 and (os.cpu_count() or 1) > 1:  # one process a device
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(len(devices), os.cpu_count() or 1)) as ex:
            parts = list(ex.map(replay_all, [sets] * len(devices), [[d] for d in devices]))
        return {k: v for part in parts for k, v in part.items()}
    out: dict[str, dict[str, dict[str, list[Result]]]] = {}
    for dev in devices:  # a drafter kind the device has no cost for is left out there
        cells = {set_name(ts): replay_set(ts, dev) for ts in sets if ts.kind in dev.draft}
        for ch in chains_of(sets):
            if all(ts.kind in dev.draft for ts in ch) and (res := replay_chain(ch, dev))["auto"]:
                name = f"{ch[0].target}:{','.join(ts.drafter for ts in ch)}:T{ch[0].temperature:g}"
                cells[name] = res
        out[getattr(dev, "name", str(dev))] = cells
    return out


def check(results: dict[str, dict[str, dict[str, list[Result]]]], min_category: float = 0.98,
          min_task: float = 0.95, vs_fixed: float = 0.97, share: float = 0.10) -> list[str]:
    """The regression gate: failures (empty: passed). `-k auto` must keep ≥ min_category × plain in
    every category median and ≥ min_task × plain on every task, and fall under vs_fixed × the best
    fixed γ in at most `share` of the (device, trace set, category) cells."""
    fails, cells, under = [], 0, []
    for dev, sets in results.items():
        for name, res in sets.items():
            auto = by_category(res["auto"])
            fixed = by_category(res["best-fixed"]) if "best-fixed" in res else {}
            for cat, rs in sorted(auto.items()):
                med = statistics.median(r.speedup for r in rs)
                if med < min_category:
                    fails.append(f"{dev} {name} {cat}: auto median {med:.3f}x plain < {min_category}")
                fails += [f"{dev} {name} {r.task}: auto {r.speedup:.3f}x plain < {min_task}"
                          for r in rs if r.speedup < min_task]
                if cat in fixed:
                    cells += 1
                    a, f = total(rs), total(fixed[cat])
                    if a < vs_fixed * f:
                        under.append(f"{dev} {name} {cat}: auto {a:.3f} vs best fixed {f:.3f}")
    if cells and len(under) > share * cells:
        fails.append(f"auto < {vs_fixed}x best fixed in {len(under)}/{cells} cells: " + "; ".join(under))
    return fails


def summary(results: dict[str, dict[str, dict[str, list[Result]]]], n_sets: int) -> str:
    tasks, cats, r_fixed, r_ctrl, r_oracle = [], [], [], [], []
    for sets in results.values():
        for res in sets.values():
            auto = res["auto"]
            tasks += [r.speedup for r in auto]
            cats += [statistics.median(r.speedup for r in rs) for rs in by_category(auto).values()]
            a = total(auto)
            r_oracle.append(a / total(res["oracle"]))
            if "best-fixed" in res:
                r_fixed.append(a / total(res["best-fixed"]))
                r_ctrl.append(a / max(total(res[c]) for c in CONTROLLERS))

    def f(xs: list[float], agg=min) -> str:
        return f"{agg(xs):.3f}" if xs else "nan"
    return (f"REPLAY traces={n_sets} devices={len(results)} auto_min_task={f(tasks)} auto_min_category={f(cats)} "
            f"auto_vs_best_fixed_median={f(r_fixed, statistics.median)} "
            f"auto_vs_best_controller_median={f(r_ctrl, statistics.median)} "
            f"auto_vs_oracle_median={f(r_oracle, statistics.median)}")


def table(dev: str, sets: dict[str, dict[str, list[Result]]]) -> str:
    names = list(sets)
    rows = ["auto", "best-fixed", *(f"k={g}" for g in SHOWN_FIXED), *CONTROLLERS, "oracle"]
    lines = [f"## {dev}: speedup / τ / ÷ oracle", "", "| policy | " + " | ".join(names) + " |",
             "|---" * (len(names) + 1) + "|"]
    for row in rows:
        cells = []
        for nm in names:
            res = sets[nm]
            if row not in res:
                cells.append("")
                continue
            s = total(res[row])
            label = f"γ{best_gamma(res)} " if row == "best-fixed" else ""
            cells.append(f"{label}{s:.2f} / {tau(res[row]):.1f} / {s / total(res['oracle']):.2f}")
        if any(cells):
            lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", action="append", help="a trace directory or file (repeatable; "
                    "default tests/fixtures/traces)")
    ap.add_argument("--device", action="append", help="'all' (the bundled devices), a name or a file (repeatable)")
    args = ap.parse_args(argv)
    from edgespec.bench.devices import bundled, load_device

    sets = [ts for path in (args.traces or ["tests/fixtures/traces"]) for ts in load_sets(path)]
    names = [d for spec in (args.device or ["all"]) for d in (bundled() if spec == "all" else [spec])]
    devices = [load_device(d) for d in names]
    if not sets:
        print("no trace sets found", file=sys.stderr)
    results = replay_all(sets, devices)
    for dev, cells in results.items():
        if cells:
            print(table(dev, cells) + "\n")
    print(summary(results, len(sets)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
