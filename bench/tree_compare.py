"""Draft trees against chains on this machine: plain, a fixed-γ chain and a fixed-γ tree of N nodes,
run in turn on each task (every run from an empty prompt cache: target and drafter reset), greedy and
sampled. Reports per temperature the median tokens/s ratio to plain, τ, and the nodes verified per
cycle; writes results.json with the commit, date and CPU model.

    .venv/bin/python bench/tree_compare.py --target smollm2-f32 --drafter smollm2 -k 4 --nodes 12 \
        --per-category 2 --out bench/results/trees

The drafter is a draft model (its tree: the chain plus the alternatives its forwards rank next,
drafters.tree_draft) or `ngram` (earlier continuations merged). A tree forward scores N + 1 tokens;
where T(N + 1) is close to T(γ + 1) (a bandwidth-bound target) the alternatives cost little.
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
    ap.add_argument("-k", "--num-draft", type=int, default=4)
    ap.add_argument("--nodes", type=int, default=12)
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--temp", type=float, action="append", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    temps = args.temp or [0.0, 0.7]

    from edgespec.backends.llama_cpp import LlamaCppBackend
    from edgespec.bench.provenance import line, provenance
    from edgespec.bench.tasks import first_per_category, load_tasks
    from edgespec.drafters.draft_model import DraftModelDrafter
    from edgespec.drafters.ngram import NgramDrafter
    from edgespec.engine import Engine
    from edgespec.models import resolve_model

    prov = provenance()
    print(f"ran at: {line(prov)}", flush=True)
    target = LlamaCppBackend(resolve_model(args.target), n_ctx=2048, threads=args.threads, tree_leaves=args.nodes)
    drafter = (NgramDrafter() if args.drafter == "ngram" else
               DraftModelDrafter(LlamaCppBackend(resolve_model(args.drafter), n_ctx=2048, threads=args.threads),
                                 target.n_vocab))
    engine = Engine(target, drafter, num_draft=args.num_draft)
    tasks = first_per_category(load_tasks(), args.per_category)
    runs = []
    for temp in temps:
        for task in tasks:
            row = {"task": task.id, "category": task.category, "temp": temp}
            for side, spec, tree in (("plain", False, 0), ("chain", True, 0), ("tree", True, args.nodes)):
                engine.reset()
                drafter.reset()
                engine.tree = tree
                t0 = time.perf_counter()
                g = engine.chat(list(task.messages), max_tokens=min(args.max_tokens, task.max_tokens),
                                temperature=temp, seed=1, speculative=spec)
                row[side] = {"s": time.perf_counter() - t0, "t_decode": g.stats.t_decode, "tokens": len(g.tokens),
                             "tau": g.stats.tau, "nodes": g.stats.n_drafted / max(1, g.stats.n_cycles),
                             "text": g.text}
            if row["plain"]["tokens"] < 8 or not row["plain"]["t_decode"]:
                print(f"T {temp} {task.id}: plain decoded {row['plain']['tokens']} tokens, skipped", flush=True)
                continue
            for side in ("chain", "tree"):
                row[side]["speedup"] = ((row[side]["tokens"] / row[side]["t_decode"])
                                        / (row["plain"]["tokens"] / row["plain"]["t_decode"]))
            row["same_text"] = row["tree"]["text"] == row["plain"]["text"] == row["chain"]["text"]
            runs.append(row)
            print(f"T {temp} {task.id:24s} chain {row['chain']['speedup']:.2f}x tau {row['chain']['tau']:.2f}  "
                  f"tree {row['tree']['speedup']:.2f}x tau {row['tree']['tau']:.2f} "
                  f"({row['tree']['nodes']:.1f} nodes/cycle)  same text {row['same_text']}", flush=True)
    summary = []
    for temp in temps:
        rs = [r for r in runs if r["temp"] == temp]
        s = {"temp": temp, "tasks": len(rs)}
        for side in ("chain", "tree"):
            s[f"{side}_speedup_median"] = statistics.median(r[side]["speedup"] for r in rs)
            s[f"{side}_tau_median"] = statistics.median(r[side]["tau"] for r in rs)
        s["tree_vs_chain_median"] = statistics.median(r["tree"]["speedup"] / r["chain"]["speedup"] for r in rs)
        summary.append(s)
        print(f"T {temp}: chain {s['chain_speedup_median']:.2f}x (tau {s['chain_tau_median']:.2f}), "
              f"tree {s['tree_speedup_median']:.2f}x (tau {s['tree_tau_median']:.2f}), "
              f"tree / chain {s['tree_vs_chain_median']:.2f} (medians over {len(rs)} tasks)")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(
            {"meta": {**vars(args), "out": str(args.out), "temps": temps, "env": prov}, "summary": summary,
             "runs": runs}, indent=1))
    engine.close()


if __name__ == "__main__":
    main()
