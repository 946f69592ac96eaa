"""edgespec bench results beside the native anchor: per category, edgespec `-k auto` tok/s against
native llama.cpp's best --spec-draft-n-max (the setting with the best median tok/s over all
tasks, and the best per category), on the same tasks and token budget.

    .venv/bin/python -m edgespec.bench.anchor_compare bench/results/smollm2-ngram/results.json out/anchor.json

Prints a markdown table. Plain speeds of both are shown: the native `--n-max 0` runs (plain
decoding through the same native loop) and edgespec's paired plain runs, so machine drift between
the two measurements is visible.

    .venv/bin/python -m edgespec.bench.anchor_compare out/anchor.json

With one file, written by `bench/anchors/native.py --edgespec-auto`: the paired table. Each (task, repeat) ran
every native n-max and edgespec `-k auto` back to back; per category it gives median tok/s and the
medians of the per-pair ratios auto ÷ native plain (n-max 0), auto ÷ native n-max N, and auto ÷ the
best native speculative n-max of that very pair (an oracle choice per task among native's
speculative settings: read it beside auto ÷ native plain, since a speculative setting can lose to
native plain).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", metavar="FILE",
                    help="results.json of `edgespec bench` (with a k=auto config) and the JSON of bench/anchors/native.py; "
                         "or only a JSON of `native.py --edgespec-auto`")
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    if len(args.files) == 1:
        paired(json.load(open(args.files[0])))
        return
    if len(args.files) != 2:
        ap.error("give an edgespec results.json and a native.py JSON, or one paired native.py JSON")
    es = json.load(open(args.files[0]))
    nat = json.load(open(args.files[1]))
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


def paired(nat: dict) -> None:
    """The table of `native.py --edgespec-auto` rows: ratios within each (task, repeat)."""
    runs = defaultdict(dict)  # (task, repeat) -> {n_max or "auto": tok/s}
    budget = defaultdict(dict)  # (task, repeat) -> {n_max: native tok/s counting only max_tokens}
    cat_of = {}
    for r in nat["rows"]:
        runs[(r["task"], r["repeat"])][r["n_max"]] = r["tok_per_s"]
        if r["n_max"] != "auto":
            budget[(r["task"], r["repeat"])][r["n_max"]] = min(r["n_tokens"], r["max_tokens"]) / r["decode_s"]
        cat_of[r["task"]] = r["category"]
    runs = {k: v for k, v in runs.items() if "auto" in v}
    if not runs:
        raise SystemExit("no edgespec rows: run native.py with --edgespec-auto")
    meta = nat["meta"]
    spec_n = sorted(n for n in meta["n_max"] if n > 0)
    med = statistics.median
    if "date" in meta:  # what the runs were: a caption over the table
        ran = f", edgespec {meta['commit']}" if "commit" in meta else ""  # results written before provenance lack it
        cpu = f"{meta['cpu']}, " if "cpu" in meta else ""
        print(f"`{meta['target'].rsplit('/', 1)[-1]}` + `{str(meta['drafter']).rsplit('/', 1)[-1]}`, "
              f"{meta['date']} ({cpu}{meta['machine']}, {meta['threads']} threads{ran}): {len(meta['tasks'])} tasks × "
              f"{meta['repeats']} repeat(s), greedy, {budget_text(nat['rows'])}.\n")
    # native plain beside native's speculative settings: a speculative setting slower than native plain
    # makes "auto ÷ best n-max" flatter edgespec; "auto ÷ native plain" does not
    print("| category | pairs | edgespec auto tok/s | native plain tok/s | "
          + " | ".join(f"native n-max {n} tok/s" for n in spec_n) + " | auto ÷ native plain | "
          + " | ".join(f"auto ÷ n-max {n}" for n in spec_n) + " | auto ÷ best n-max of each pair | "
          "the same, native counted to the budget |")
    print("|---" * (7 + 2 * len(spec_n)) + "|")
    for cat in sorted(set(cat_of.values())) + ["all"]:
        keys = [k for k in runs if cat in ("all", cat_of[k[0]])]
        rs = [runs[k] for k in keys]
        plain = f"{med(v[0] for v in rs):.1f}" if all(0 in v for v in rs) else "–"
        vs_plain = f"{med(v['auto'] / v[0] for v in rs):.2f}" if all(0 in v for v in rs) else "–"
        speeds = " | ".join(f"{med(v[n] for v in rs):.1f}" for n in spec_n)
        ratios = " | ".join(f"{med(v['auto'] / v[n] for v in rs):.2f}" for n in spec_n)
        best = med(v["auto"] / max(v[n] for n in spec_n) for v in rs)
        # native drafts past the budget in its last cycle (up to n-max tokens): counting only the
        # budget's tokens in the same time bounds its rate from below
        capped = med(runs[k]["auto"] / max(budget[k][n] for n in spec_n) for k in keys)
        print(f"| {cat} | {len(rs)} | {med(v['auto'] for v in rs):.1f} | {plain} | {speeds} | {vs_plain} | {ratios} | "
              f"**{best:.2f}** | {capped:.2f} |")


def budget_text(rows: list[dict]) -> str:
    """The runs' token budget, or the range of the tasks' own budgets."""
    lo, hi = min(r["max_tokens"] for r in rows), max(r["max_tokens"] for r in rows)
    return f"{lo} tokens" if lo == hi else f"the tasks' own budgets ({lo}–{hi} tokens)"


if __name__ == "__main__":
    main()
