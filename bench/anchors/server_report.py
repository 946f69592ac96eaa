"""The server anchor's summary (bench/anchors/server_anchor.py): medians per (config, suite,
category), ratios paired by request and round, the best llama-server n-gram type, greedy text
mismatches and the markdown tables. Pure functions over the per-request records."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

LLAMA, EDGESPEC = "llama-server", "edgespec"
PLAIN = {LLAMA: "llama:plain", EDGESPEC: "edgespec:plain"}
ALL = "all"  # the category row over every request of a suite


def _median(xs: Iterable[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _key(r: dict[str, Any]) -> tuple[str, str, int]:
    return r["suite"], r["request"], r["round"]


def summarise(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians per (config, suite, category), categories plus ALL:

    tok_per_s      median of the requests' own predicted_per_second (requests without a speed left out)
    pooled_tok_per_s  Σ tokens ÷ Σ decode seconds over the group (llama-server: first tokens not counted)
    speedup        median over (request, round) of tok/s ÷ the same implementation's plain tok/s
    acceptance     Σ draft_n_accepted ÷ Σ draft_n;  tau: median of the requests' τ
    vs_best_llama  (edgespec spec configs) median over (request, round) of tok/s ÷ the tok/s of the
                   llama-server n-gram type with the highest median tok/s in that (suite, category)
    vs_llama_plain (every config) median of tok/s ÷ llama:plain's tok/s
    """
    by_cfg_key = {(r["config"], *_key(r)): r for r in records}
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    impl_of = {r["config"]: (r["impl"], r["spec"]) for r in records}
    for r in records:
        for cat in (r["category"], ALL):
            groups.setdefault((r["config"], r["suite"], cat), []).append(r)

    def speed(r: dict[str, Any] | None) -> float | None:
        return r["tok_per_s"] if r is not None and r["tok_per_s"] > 0 else None

    def ratios(rows: list[dict[str, Any]], other: str) -> list[float]:
        out = []
        for r in rows:
            a, b = speed(r), speed(by_cfg_key.get((other, *_key(r))))
            if a is not None and b is not None:
                out.append(a / b)
        return out

    rows: list[dict[str, Any]] = []
    for (cfg, suite, cat), rs in groups.items():
        impl, spec = impl_of[cfg]
        speeds = [s for s in map(speed, rs) if s is not None]
        dn = sum(r["draft_n"] or 0 for r in rs)
        da = sum(r["draft_n_accepted"] or 0 for r in rs)
        toks = sum(max((r["predicted_n"] or 0) - (1 if impl == LLAMA else 0), 0) for r in rs if r["predicted_ms"])
        ms = sum(r["predicted_ms"] or 0.0 for r in rs)
        plain = PLAIN[impl]
        sp = ratios(rs, plain) if spec and any(c == plain for c, *_ in by_cfg_key) else []
        vlp = ratios(rs, PLAIN[LLAMA]) if cfg != PLAIN[LLAMA] else []
        rows.append({
            "config": cfg, "impl": impl, "spec": spec, "suite": suite, "category": cat,
            "n_requests": len(rs), "n_timed": len(speeds),
            "tok_per_s": _median(speeds), "pooled_tok_per_s": toks / (ms / 1000) if ms > 0 else None,
            "speedup": _median(sp), "n_pairs": len(sp),
            "acceptance": da / dn if dn else None, "draft_n": dn, "draft_n_accepted": da,
            "tau": _median(r["tau"] for r in rs), "vs_llama_plain": _median(vlp),
        })
    best = best_llama_types(rows)
    for row in rows:
        if row["impl"] == EDGESPEC and row["spec"]:
            b = best.get((row["suite"], row["category"]))
            row["best_llama"] = b
            if b is not None:
                row["vs_best_llama"] = _median(ratios(groups[(row["config"], row["suite"], row["category"])], b))
    order = {c: i for i, c in enumerate(dict.fromkeys(r["config"] for r in records))}
    rows.sort(key=lambda r: (r["suite"], r["category"] == ALL, r["category"], order[r["config"]]))
    return {"rows": rows, "best_llama": {f"{s}/{c}": b for (s, c), b in sorted(best.items())}}


def best_llama_types(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """(suite, category) -> the llama-server speculative config with the highest median tok/s there."""
    best: dict[tuple[str, str], tuple[float, str]] = {}
    for r in rows:
        if r["impl"] == LLAMA and r["spec"] and r["tok_per_s"] is not None:
            k = (r["suite"], r["category"])
            if k not in best or r["tok_per_s"] > best[k][0]:
                best[k] = (r["tok_per_s"], r["config"])
    return {k: v[1] for k, v in best.items()}


def first_difference(a: str, b: str) -> int:
    i = 0
    for x, y in zip(a, b):
        if x != y:
            break
        i += 1
    return i


def text_mismatches(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Greedy texts that differ, per (suite, request, round): llama:plain vs edgespec:plain (the
    implementations; template or tokenization differences may show here), and every speculative
    config vs its own implementation's plain server (speculation must not change greedy text)."""
    by = {(r["config"], *_key(r)): r for r in records}
    pairs = [(PLAIN[LLAMA], PLAIN[EDGESPEC])]
    pairs += sorted({(PLAIN[r["impl"]], r["config"]) for r in records if r["spec"]})
    out = []
    for a, b in pairs:
        for (cfg, suite, request, rnd), ra in sorted(by.items()):
            if cfg != a:
                continue
            rb = by.get((b, suite, request, rnd))
            if rb is None or ra["text"] == rb["text"]:
                continue
            i = first_difference(ra["text"], rb["text"])
            out.append({"a": a, "b": b, "suite": suite, "request": request, "round": rnd, "at_char": i,
                        "a_text": ra["text"][max(0, i - 20): i + 40], "b_text": rb["text"][max(0, i - 20): i + 40],
                        "a_len": len(ra["text"]), "b_len": len(rb["text"])})
    return out


def _fmt(x: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "–" if x is None else f"{x:{spec}}{suffix}"


def markdown(summary: dict[str, Any], mismatches: Sequence[dict[str, Any]], rounds: int) -> str:
    """The summary as markdown tables, one per suite."""
    out: list[str] = []
    suites = list(dict.fromkeys(r["suite"] for r in summary["rows"]))
    for suite in suites:
        out += [f"### {suite} (medians over requests × {rounds} round{'s' if rounds != 1 else ''})", "",
                "| category | config | n | tok/s | speedup vs own plain | acceptance | τ | ÷ llama plain | "
                "÷ best llama n-gram |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in (r for r in summary["rows"] if r["suite"] == suite):
            cross = "–"
            if r.get("vs_best_llama") is not None:
                cross = f"**{r['vs_best_llama']:.2f}** ({r['best_llama'].removeprefix('llama:')})"
            out.append(f"| {r['category']} | {r['config']} | {r['n_timed']} | {_fmt(r['tok_per_s'])} | "
                       f"{_fmt(r['speedup'], '.2f')} | {_fmt(r['acceptance'], '.2f')} | {_fmt(r['tau'], '.2f')} | "
                       f"{_fmt(r['vs_llama_plain'], '.2f')} | {cross} |")
        out.append("")
    n_impl = sum(1 for m in mismatches if m["a"] == PLAIN[LLAMA] and m["b"] == PLAIN[EDGESPEC])
    n_spec = len(mismatches) - n_impl
    out.append(f"Greedy text mismatches: llama:plain vs edgespec:plain {n_impl}; speculative vs own plain {n_spec} "
               "(details: the JSON's `mismatches`).")
    return "\n".join(out)


def report(path: str) -> str:
    """A result file of server_anchor.py as markdown: its command line, then the tables."""
    import json

    with open(path, encoding="utf-8") as f:
        result = json.load(f)
    args, env = result["meta"]["args"], result["meta"]["environment"]
    suites = " ".join(f"--suite {s}" for s in args["suite"])
    head = (f"`.venv/bin/python bench/anchors/server_anchor.py --target {args['target'].rsplit('/', 1)[-1]} "
            f"{suites} --rounds {args['rounds']}` ({env['date']}, {env.get('cpu') or '?'}, {env['cpus']} CPUs, "
            f"edgespec {env.get('commit') or env['edgespec_commit'][:7]}, llama-server {env['llama_server_version'][0].removeprefix('version: ')}).\n\n")
    return head + markdown(result["summary"], result["mismatches"], args["rounds"])


if __name__ == "__main__":
    import sys

    print(report(sys.argv[1]))
