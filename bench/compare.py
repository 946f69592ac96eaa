"""One table over several `edgespec bench` result directories: every drafter side by side.

    .venv/bin/python bench/compare.py bench/results/smollm2-ngram bench/results/smollm2-eagle3-heldout ...

Per directory and temperature it takes the "all" rows: the fixed γ with the best median speedup
here, the one with the best predicted memory-bound speedup (when it differs) and `k=auto`. Columns
are read from each directory's results.json (written by `edgespec bench`, with the commit it ran on:
"?" for results written before bench recorded it); nothing is re-measured
(for results written before bench reported draft cost and the prediction, both are computed from
the stored cycles the same way, bench.run.memory_bound_prediction).
Predicted memory-bound speedups are predictions (see the bench tables' header).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

from edgespec.bench.run import is_fixed_gamma, memory_bound_prediction


def rows(result_dir: Path, temperatures: set[float] | None = None) -> list[dict]:
    data = json.loads((result_dir / "results.json").read_text())
    meta, out = data["meta"], []
    tasks = "held-out prompts" if any(t.startswith("heldout") for t in meta["tasks"]) else "bench tasks"
    for temp in sorted({r["temperature"] for r in data["summary"]}):
        if temperatures and temp not in temperatures:
            continue
        alls = [r for r in data["summary"] if r["temperature"] == temp and r["category"] == "all"]
        fixed = [r for r in alls if is_fixed_gamma(r["config"])]
        picked = []
        if fixed:
            picked.append(max(fixed, key=lambda r: r["speedup_median"]))
            best_pred = max(fixed, key=lambda r: r.get("predicted_memory_bound", 0.0))
            if best_pred is not picked[0] and "predicted_memory_bound" in best_pred:
                picked.append(best_pred)
        picked += [r for r in alls if r["config"].endswith("k=auto")]
        for r in picked:
            if "predicted_memory_bound" not in r:  # results written before bench computed it
                runs = [SimpleNamespace(**x) for x in data["runs"] if x["config"] == r["config"]
                        and x["temperature"] == temp]
                r = {**r, **memory_bound_prediction(runs)}
            drafter, _, k = r["config"].rpartition(" ")
            out.append({"target": Path(meta["target"]).name, "drafter": drafter, "k": k, "temp": temp,
                        "tasks": f"{tasks} ({len(meta['tasks'])})", "tau": r["tau"],
                        "cost": r.get("draft_cost_vs_t1"), "speedup": r["speedup_median"],
                        "predicted": r.get("predicted_memory_bound"), "dir": result_dir.name,
                        "commit": meta.get("env", {}).get("commit", "?")})
    return out


def markdown(table: list[dict]) -> str:
    def num(x: float | None, fmt: str) -> str:
        return "–" if x is None else format(x, fmt)

    lines = ["| target | drafter | γ | temp | tasks | τ | draft cost ÷ T(1) | speedup here (median) | "
             "predicted memory-bound | results (commit) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['target']} | {r['drafter']} | {r['k']} | {r['temp']:g} | {r['tasks']} | {r['tau']:.2f} | "
                     f"{num(r['cost'], '.3f')} | {r['speedup']:.2f} | {num(r['predicted'], '.2f')} | {r['dir']} ({r['commit']}) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="bench result directories (each with results.json)")
    ap.add_argument("--temp", type=float, action="append", help="only these temperatures (repeatable)")
    args = ap.parse_args()
    missing = [d for d in args.dirs if not (d / "results.json").is_file()]
    if missing:
        ap.error(f"no results.json in {', '.join(map(str, missing))}")
    print(markdown([r for d in args.dirs for r in rows(d, set(args.temp) if args.temp else None)]), end="")


if __name__ == "__main__":
    main()
