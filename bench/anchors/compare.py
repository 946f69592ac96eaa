"""edgespec bench results beside the native anchor: per category, edgespec `-k auto` tok/s against
native llama.cpp's best --spec-draft-n-max (the setting with the best median tok/s over all
tasks, and the best per category), on the same tasks and token budget.

    .venv/bin/python bench/anchors/compare.py bench/results/smollm2-ngram/results.json out/anchor.json

Prints a markdown table. Plain speeds of both are shown: the native `--n-max 0` runs (plain
decoding through the same native loop) and edgespec's paired plain runs, so machine drift between
the two measurements is visible.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("edgespec", help="results.json of `edgespec bench` (with a k=auto config)")
    ap.add_argument("native", help="JSON written by native.py")
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    es = json.load(open(args.edgespec))
    nat = json.load(open(args.native))
    auto = [r for r in es["runs"] if r["config"].endswith("k=auto") and r["temperature"] == args.temperature]
    plain = [r for r in es["runs"] if r["config"] == "plain" and r["temperature"] == args.temperature]
    tasks = {r["task"] for r in auto}
    rows = [r for r in nat["rows"] if r["task"] in tasks]
    by = defaultdict(list)  # (n_max, category) -> tok/s
    for r in rows:
        by[(r["n_max"], r["category"])].append(r["tok_per_s"])
        by[(r["n_max"], "all")].append(r["tok_per_s"])
    spec_n = sorted({n for n, _ in by if n > 0})
    best_all = max(spec_n, key=lambda n: statistics.median(by[(n, "all")]))
    cats = sorted({r["category"] for r in auto}) + ["all"]
    med = statistics.median
    print(f"| category | edgespec auto tok/s | edgespec plain tok/s | native n-max {best_all} tok/s | "
          f"native best n-max (per category) | native plain tok/s | auto ÷ native best |")
    print("|---|---|---|---|---|---|---|")
    for cat in cats:
        a = [r["tok_per_s"] for r in auto if cat in ("all", r["category"])]
        p = [r["tok_per_s"] for r in plain if cat in ("all", r["category"])]
        n_cat = max(spec_n, key=lambda n: med(by[(n, cat)]))
        best = med(by[(n_cat, cat)])
        native_plain = f"{med(by[(0, cat)]):.1f}" if by.get((0, cat)) else "–"
        print(f"| {cat} | {med(a):.1f} | {med(p):.1f} | {med(by[(best_all, cat)]):.1f} | "
              f"{best:.1f} (n-max {n_cat}) | {native_plain} | **{med(a) / best:.2f}** |")


if __name__ == "__main__":
    main()
