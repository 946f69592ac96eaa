"""Draft trees against chains on this machine: plain, a fixed-γ chain and a fixed-γ tree of N nodes
(one per --nodes), run in turn on each task (every run from an empty prompt cache: target and drafter
reset), greedy and sampled. Reports per temperature the median tokens/s ratio to plain, τ, and the
nodes verified per cycle; writes results.json with the commit, date and CPU model.

    .venv/bin/python bench/tree_compare.py --target smollm2-f32 --drafter smollm2 -k 4 --nodes 12 \
        --per-category 2 --out bench/results/trees
    .venv/bin/python bench/tree_compare.py --target smollm2 --drafter medusa.gguf -k 3 --nodes 8 --nodes 16 \
        --tasks bench/heldout/heads.jsonl --per-category 8 --temp 0 --out bench/results/medusa-smollm2
    .venv/bin/python bench/tree_compare.py --target smollm2-f32 --drafter models/smollm2-135m-eagle3.gguf \
        -k auto --per-category 2 --temp 0 --out bench/results/trees-auto

With `-k auto` the sides are `-k auto` chains and `-k auto --tree auto` (schedule.trees), each on its
own engine (calibrated first: what one learns never reaches the other), each run from an empty cache.

The drafter is a draft model (its tree: the chain plus the alternatives its forwards rank next,
drafters.tree_draft), `ngram` (earlier continuations merged) or a head GGUF such as Medusa heads (their
candidate tree), opened as `edgespec.load` opens any --drafter. A tree forward scores N + 1 tokens;
where T(N + 1) is close to T(γ + 1) (a bandwidth-bound target) the alternatives cost little.
With one --nodes the results name the tree side "tree", with several "tree<N>".
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-f32")
    ap.add_argument("--drafter", default="smollm2")
    ap.add_argument("-k", "--num-draft", default="4", help="γ, or auto (chains against --tree auto)")
    ap.add_argument("--nodes", type=int, action="append", default=None, help="tree nodes (repeatable; default 12)")
    ap.add_argument("--tasks", default=None, help="a tasks .jsonl or folder (default: the shipped suite)")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--temp", type=float, action="append", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    temps = args.temp or [0.0, 0.7]
    args.nodes = args.nodes or [12]
    auto = args.num_draft == "auto"
    trees = ([("tree", "auto" if auto else args.nodes[0])] if len(args.nodes) == 1 or auto
             else [(f"tree{n}", n) for n in args.nodes])

    from edgespec.api import load
    from edgespec.bench.provenance import line, provenance
    from edgespec.bench.tasks import first_per_category, load_tasks

    prov = provenance()
    print(f"ran at: {line(prov)}", flush=True)
    # the target opened for the largest tree (tree_leaves), and as the drafter needs (a head's capture)
    gamma = "auto" if auto else int(args.num_draft)
    engine = load(args.target, args.drafter, num_draft=gamma, tree="off" if auto else max(args.nodes), n_ctx=2048,
                  threads=args.threads)  # -k auto: plain and chains as a user without --tree gets them
    engines = {"plain": engine, "chain": engine, **{side: engine for side, _ in trees}}
    if auto:  # the tree side on its own engine: the two schedulers learn apart
        engines["tree"] = load(args.target, args.drafter, num_draft="auto", tree="auto", n_ctx=2048,
                               threads=args.threads)
        for e in {id(e): e for e in engines.values()}.values():
            e.calibrate()
    tasks = first_per_category(load_tasks(args.tasks), args.per_category)
    sides = [side for side, _ in trees]
    runs = []
    for temp in temps:
        for task in tasks:
            row = {"task": task.id, "category": task.category, "temp": temp}
            for side, spec, tree in (("plain", False, 0), ("chain", True, 0), *((s, True, n) for s, n in trees)):
                e = engines[side]
                e.reset()
                e.drafter.reset()
                e.tree = tree
                t0 = time.perf_counter()
                g = e.chat(list(task.messages), max_tokens=min(args.max_tokens, task.max_tokens),
                                temperature=temp, seed=1, speculative=spec)
                row[side] = {"s": time.perf_counter() - t0, "t_decode": g.stats.t_decode, "tokens": len(g.tokens),
                             "tau": g.stats.tau, "cycles": g.stats.n_cycles,
                             "nodes": g.stats.n_drafted / max(1, g.stats.n_cycles),
                             "text": g.text}
            if row["plain"]["tokens"] < 8 or not row["plain"]["t_decode"]:
                print(f"T {temp} {task.id}: plain decoded {row['plain']['tokens']} tokens, skipped", flush=True)
                continue
            for side in ("chain", *sides):
                row[side]["speedup"] = ((row[side]["tokens"] / row[side]["t_decode"])
                                        / (row["plain"]["tokens"] / row["plain"]["t_decode"]))
            row["same_text"] = all(row[side]["text"] == row["plain"]["text"] for side in ("chain", *sides))
            runs.append(row)
            print(f"T {temp} {task.id:24s} chain {row['chain']['speedup']:.2f}x tau {row['chain']['tau']:.2f}  " +
                  "  ".join(f"{side} {row[side]['speedup']:.2f}x tau {row[side]['tau']:.2f} "
                            f"({row[side]['nodes']:.1f} nodes/cycle)" for side in sides) +
                  f"  same text {row['same_text']}", flush=True)
    summary = []
    for temp in temps:
        rs = [r for r in runs if r["temp"] == temp]
        s = {"temp": temp, "tasks": len(rs), "same_text": sum(r["same_text"] for r in rs)}
        for side in ("chain", *sides):
            s[f"{side}_speedup_median"] = statistics.median(r[side]["speedup"] for r in rs)
            s[f"{side}_tau_median"] = statistics.median(r[side]["tau"] for r in rs)
            # τ over all cycles of all tasks: tokens per target pass (as bench's per-config τ)
            s[f"{side}_tau_pooled"] = (sum(r[side]["tau"] * r[side]["cycles"] for r in rs)
                                       / max(1, sum(r[side]["cycles"] for r in rs)))
        for side in sides:
            s[f"{side}_vs_chain_median"] = statistics.median(r[side]["speedup"] / r["chain"]["speedup"] for r in rs)
        summary.append(s)
        print(f"T {temp}: chain {s['chain_speedup_median']:.2f}x (tau {s['chain_tau_median']:.2f}, pooled "
              f"{s['chain_tau_pooled']:.2f}), " +
              ", ".join(f"{side} {s[f'{side}_speedup_median']:.2f}x (tau {s[f'{side}_tau_median']:.2f}, pooled "
                        f"{s[f'{side}_tau_pooled']:.2f}), {side} / chain {s[f'{side}_vs_chain_median']:.2f}"
                        for side in sides) +
              f"; same text as plain {s['same_text']}/{len(rs)} (medians over {len(rs)} tasks)")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(
            {"meta": {**vars(args), "out": str(args.out), "temps": temps, "env": prov}, "summary": summary,
             "runs": runs}, indent=1))
    for e in {id(e): e for e in engines.values()}.values():
        e.close()


if __name__ == "__main__":
    main()
