"""Replay recorded drafter traces (edgespec.bench.trace) under every policy on every device's costs.

A trace holds, for one task, the target's output and the draft the drafter proposes at every position
from the true context; edgespec.bench.simulate replays one trace under one policy on one device's
costs (exact when greedy; at T > 0 a Bernoulli model of recorded acceptance, an approximation).

Policies:
- `auto`: the real Scheduler (ChainScheduler for chains) built from the device's costs and fed the
  modeled times in seconds as the engine feeds it, one per trace set (what it learns carries over
  tasks, `new_generation` per task): a pair's first run on the machine;
- `auto-warm`: the same on a pair run before, its schedulers starting from the pair records a first
  pass over the same tasks left (as an engine starts from what earlier ones kept on disk);
- every fixed γ (1..15, 1..31 for a copying drafter) and `best-fixed`, the best over the whole set
  (what MTPLX `tune` picks);
- the controllers of edgespec.bench.policies (llama.cpp, transformers, ik_llama.cpp, BeeLlama);
- `oracle`: the best γ per cycle knowing the output (a dynamic program; at T > 0 over the expected
  accepted length from accept[]), the ceiling.
Chains (a copying and a costly drafter of one target and temperature) get `auto`, `auto-warm` and
`oracle` only.

    .venv/bin/python -m edgespec.bench.replay --traces tests/fixtures/traces --device all    # make replay

Ends with one line: REPLAY traces=<trace sets> devices=<devices> auto_min_task=… auto_min_category=…
auto_vs_best_fixed_median=… auto_vs_best_controller_median=… auto_vs_oracle_median=… (medians over
(device, trace set) cells of the whole-set speedup ratios), then the same five for auto-warm
(warm_…). `check` is the regression gate (tests/test_replay_gate.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from edgespec.bench import policies as pol
from edgespec.bench.simulate import Costs, Result, oracle, prepare, run_autos, run_controller
from edgespec.bench.trace import TraceSet
from edgespec.schedule.costs import K_MAX

CONTROLLERS = ("llama.cpp", "hf-heuristic", "ik-autotune", "bee-profit")
SHOWN_FIXED = (1, 2, 4, 8, 15, 31)


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
    res = run_autos([(ts, tasks)], device)
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
    return {**run_autos(members, device),
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
    files = sorted(path.rglob("*.json.gz")) if path.is_dir() else [path] if path.exists() else []
    return [TraceSet.load(f) for f in files]


def chain_name(chain: list[TraceSet]) -> str:
    return f"{chain[0].target}:{','.join(ts.drafter for ts in chain)}:T{chain[0].temperature:g}"


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
                cells[chain_name(ch)] = res
        out[getattr(dev, "name", str(dev))] = cells
    return out


AUTO = ("auto", "auto-warm")  # -k auto on a pair's first run on the machine, and on a pair run before
GATE = {"category": 0.98, "task": 0.95, "vs_fixed": 0.97, "share": 0.10}  # the regression gate's bounds (#48)


def shortfalls(results: dict[str, dict[str, dict[str, list[Result]]]]) -> dict[str, float]:
    """Where `-k auto` (each policy of AUTO) misses the gate, {what: its value}: a category median under
    GATE["category"] × plain ("<device> <set> <category> median"; "warm" before the category for
    auto-warm), a task under GATE["task"] × plain ("<device> <set> [warm ]<task>"), and the share of
    (device, trace set, category, policy) cells under GATE["vs_fixed"] × the best fixed γ ("cells
    under best fixed"), when it is over GATE["share"]."""
    out, cells, under = {}, 0, 0
    for dev, sets in results.items():
        for name, res in sets.items():
            fixed = by_category(res["best-fixed"]) if "best-fixed" in res else {}
            for policy in AUTO:
                tag = "" if policy == "auto" else "warm "
                for cat, rs in sorted(by_category(res[policy]).items()):
                    med = statistics.median(r.speedup for r in rs)
                    if med < GATE["category"]:
                        out[f"{dev} {name} {tag}{cat} median"] = med
                    out |= {f"{dev} {name} {tag}{r.task}": r.speedup for r in rs if r.speedup < GATE["task"]}
                    if cat in fixed:
                        cells += 1
                        under += total(rs) < GATE["vs_fixed"] * total(fixed[cat])
    if cells and under > GATE["share"] * cells:
        out["cells under best fixed"] = under / cells
    return out


def check(results: dict[str, dict[str, dict[str, list[Result]]]]) -> list[str]:
    """The regression gate's failures, one line each (empty: passed)."""
    return [f"{k}: {v:.3f}" for k, v in shortfalls(results).items()]


def summary(results: dict[str, dict[str, dict[str, list[Result]]]], n_sets: int) -> str:
    """The REPLAY line: `-k auto` on a pair's first run (auto_*), then on a pair run before (warm_*)."""
    def part(policy: str, prefix: str) -> str:
        tasks, cats, r_fixed, r_ctrl, r_oracle = [], [], [], [], []
        for sets in results.values():
            for res in sets.values():
                auto = res[policy]
                tasks += [r.speedup for r in auto]
                cats += [statistics.median(r.speedup for r in rs) for rs in by_category(auto).values()]
                a = total(auto)
                r_oracle.append(a / total(res["oracle"]))
                if "best-fixed" in res:
                    r_fixed.append(a / total(res["best-fixed"]))
                    r_ctrl.append(a / max(total(res[c]) for c in CONTROLLERS))

        def f(xs: list[float], agg=min) -> str:
            return f"{agg(xs):.3f}" if xs else "nan"
        return (f"{prefix}_min_task={f(tasks)} {prefix}_min_category={f(cats)} "
                f"{prefix}_vs_best_fixed_median={f(r_fixed, statistics.median)} "
                f"{prefix}_vs_best_controller_median={f(r_ctrl, statistics.median)} "
                f"{prefix}_vs_oracle_median={f(r_oracle, statistics.median)}")
    return f"REPLAY traces={n_sets} devices={len(results)} {part('auto', 'auto')} {part('auto-warm', 'warm')}"


def table(dev: str, sets: dict[str, dict[str, list[Result]]]) -> str:
    names = list(sets)
    rows = [*AUTO, "best-fixed", *(f"k={g}" for g in SHOWN_FIXED), *CONTROLLERS, "oracle"]
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
    ap.add_argument("--shortfalls", metavar="FILE", help="write where auto misses the gate (JSON) to FILE: "
                    "the known shortfalls tests/test_replay_gate.py holds the scheduler to")
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
    misses = shortfalls(results)
    print(f"gate: {len(misses)} shortfalls" + (f" (first: {next(iter(misses))})" if misses else ""))
    print(summary(results, len(sets)))
    if args.shortfalls:
        Path(args.shortfalls).write_text(json.dumps({k: round(v, 4) for k, v in sorted(misses.items())}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
