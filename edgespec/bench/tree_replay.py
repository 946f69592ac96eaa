"""Draft trees replayed: chain against tree against `--tree auto`, per (drafter, device, category), on
trace sets recorded with trees (edgespec.bench.record --tree-nodes): greedy, where every path is exact,
and sampled side trees (their recorded chances, edgespec.bench.simulate.sampled_path: an approximation
as the chain replay's at T > 0).

Policies, each over a whole trace set on one device's costs (edgespec.bench.simulate's cost model):
- `chain`: `-k auto` with chains only (replay's `auto`);
- `tree-auto`: `-k auto --tree auto`, the real Scheduler with schedule.trees.TreeScheduling over the
  recorded trees (up to TREE_NODES nodes), on modeled time;
- `best-chain`: the best fixed γ over the set; `best-tree`: the best fixed (depth γ, nodes N) tree
  over the set (γ 1..8, N in NODES), each position's recorded tree cut to depth γ, then to its first
  N nodes (parents first), drafted at its chain's cost (an approximation for EAGLE-2's dynamic
  trees, whose expansions cost more than their chain).

    .venv/bin/python -m edgespec.bench.tree_replay --traces DIR --device all

prints one table per device (speedup over plain per policy and category) and a TREES line (`summary`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from edgespec.bench import policies as pol
from edgespec.bench.replay import by_category, load_sets, set_name, total
from edgespec.bench.simulate import (
    Costs,
    Result,
    Task,
    _limit,
    _run_auto,
    plain_ms,
    prepare,
    recorded_tree,
    run_controller,
    sampled_path,
    sampled_side_tree,
    tree_path,
)
from edgespec.bench.trace import TraceSet
from edgespec.schedule.costs import K_MAX

TREE_NODES = K_MAX - 1  # what --tree auto may verify
NODES = (2, 4, 8, 16, 31)
POLICIES = ("chain", "tree-auto", "best-chain", "best-tree")


def run_tree_fixed(task: Task, c: Costs, gamma: int, nodes: int) -> Result:
    """One task verifying, every cycle, the recorded tree cut to depth γ and its first `nodes` nodes."""
    tr, ms, cycles, p, seen = task.trace, 0.0, 0, 0, 0
    assert tr.trees is not None
    n, ctx0 = len(tr.output), tr.prompt_len - 1
    sampled = task.sibling_u is not None
    while p < n:
        limit = _limit(tr, p)
        tree = None
        if limit:
            tree = (sampled_side_tree(tr, p, tr.drafts[p][:min(gamma, limit)], nodes) if sampled
                    else recorded_tree(tr, p, min(gamma, limit), nodes))
        k = tree.n_nodes if tree is not None else 0
        acc = len(sampled_path(tree, task, p) if sampled else tree_path(tree, tr.output, p)) if k else 0
        t_draft = c.draft(len(tree.first_chain())) if k else 0.0
        if k and c.read_ms:
            t_draft += max(0, ctx0 + p - seen) * c.read_ms
            seen = ctx0 + p + 1 + acc
        ms, cycles, p = ms + t_draft + c.verify(k + 1, ctx0 + p), cycles + 1, p + acc + 1
    return Result(tr.task, tr.category, ms, plain_ms(task, c), n, cycles)


def replay_trees(ts: TraceSet, device: Any) -> dict[str, list[Result]]:
    """The POLICIES over one tree trace set on one device: {policy: per-task results}."""
    tasks = [prepare(t, ts.temperature) for t in ts.traces]
    c = Costs(device, ts.kind)
    chains = {g: [run_controller(t, c, pol.Fixed(g)) for t in tasks] for g in range(1, 16)}
    trees = {(g, m): [run_tree_fixed(t, c, g, m) for t in tasks] for g in range(1, 9) for m in NODES}
    return {"chain": _run_auto([(ts, tasks)], device, None)[0],
            "tree-auto": _run_auto([(ts, tasks)], device, None, TREE_NODES)[0],
            "best-chain": max(chains.values(), key=total), "best-tree": max(trees.values(), key=total)}


def cells(results: dict[str, dict[str, dict[str, list[Result]]]]) -> list[tuple[str, str, str, dict[str, float]]]:
    """(device, set, category, {policy: speedup over plain}) per cell."""
    out = []
    for dev, sets in results.items():
        for name, res in sets.items():
            cats = {p: by_category(rs) for p, rs in res.items()}
            for cat in sorted(cats["chain"]):
                out.append((dev, name, cat, {p: total(cats[p][cat]) for p in POLICIES}))
    return out


def summary(rows: list[tuple[str, str, str, dict[str, float]]],
            results: dict[str, dict[str, dict[str, list[Result]]]]) -> str:
    """The TREES line: per (device, set, category) cell, tree-auto ÷ the better of chain auto and the
    best fixed tree, and ÷ chain auto; per (device, set), tree-auto ÷ chain auto over the whole set;
    the cells where the best fixed tree beats the best fixed chain, and by how much."""
    def f(xs: list[float], agg) -> str:
        return f"{agg(xs):.3f}" if xs else "nan"
    better = [s["tree-auto"] / max(s["chain"], s["best-tree"]) for *_, s in rows]
    vs_chain = [s["tree-auto"] / s["chain"] for *_, s in rows]
    sets = [total(res["tree-auto"]) / total(res["chain"]) for cells_ in results.values() for res in cells_.values()]
    wins = [s["best-tree"] / s["best-chain"] for *_, s in rows if s["best-tree"] > s["best-chain"]]
    return (f"TREES cells={len(rows)} tree_auto_vs_better_min={f(better, min)} "
            f"tree_auto_vs_better_median={f(better, statistics.median)} tree_auto_vs_chain_min={f(vs_chain, min)} "
            f"tree_auto_vs_chain_median={f(vs_chain, statistics.median)} sets={len(sets)} "
            f"set_tree_auto_vs_chain_min={f(sets, min)} set_tree_auto_vs_chain_median={f(sets, statistics.median)} "
            f"cells_tree_beats_chain={len(wins)} tree_vs_chain_there_median={f(wins, statistics.median)} "
            f"max={f(wins, max)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", action="append", required=True, help="a trace directory or file with trees")
    ap.add_argument("--device", action="append", help="'all' (the bundled devices), a name or a file")
    args = ap.parse_args(argv)
    from edgespec.bench.devices import bundled, load_device

    sets = [ts for path in args.traces for ts in load_sets(path)
            if all(t.trees is not None and (ts.temperature == 0 or t.tree_accept is not None) for t in ts.traces)]
    if not sets:
        print("no trace sets with trees found", file=sys.stderr)
        return 1
    devices = [load_device(d) for spec in (args.device or ["all"]) for d in (bundled() if spec == "all" else [spec])]
    results = {getattr(d, "name", str(d)): {set_name(ts): replay_trees(ts, d) for ts in sets if ts.kind in d.draft}
               for d in devices}
    rows = cells(results)
    for dev in results:
        print(f"## {dev}: speedup over plain\n\n| set | category | " + " | ".join(POLICIES)
              + " | tree-auto ÷ better |\n|---|---|" + "---|" * (len(POLICIES) + 1))
        for d, name, cat, s in rows:
            if d == dev:
                print(f"| {name} | {cat} | " + " | ".join(f"{s[p]:.3f}" for p in POLICIES)
                      + f" | {s['tree-auto'] / max(s['chain'], s['best-tree']):.3f} |")
        print()
    print(summary(rows, results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
