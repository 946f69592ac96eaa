"""Bench results → results.json, results.md (tables) and PNG plots (matplotlib, optional)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from edgespec.bench import provenance
from edgespec.bench.run import is_fixed_gamma


def write_json(path: Path, meta: dict, summary: list[dict], runs: list[dict], turns: Sequence[dict] = ()) -> None:
    """results.json: meta, summary rows, every run, and (sessions) the by-turn rows."""
    data = {"meta": meta, "summary": summary, "runs": runs, **({"by_turn": list(turns)} if turns else {})}
    path.write_text(json.dumps(data, separators=(",", ":")))


def markdown(meta: dict, summary: Sequence[dict], plots: Sequence[str] = (), turns: Sequence[dict] = ()) -> str:
    lines = [f"# edgespec bench — {Path(meta['target']).name}", "",
             f"Command: `{meta['command']}`", "",
             f"Ran at: {provenance.line(meta['env'])}", "",
             f"Machine: {meta['env']['platform']}, {meta['env']['machine']}, {meta['threads']} threads · "
             f"edgespec {meta['env']['edgespec']} · llama-cpp-python {meta['env']['llama_cpp']}",
             "", "Models: " + ", ".join(f"`{Path(p).name}` ({h[:12]}…)" for p, h in meta["sha256"].items()), "",
             "Speedup = spec tok/s ÷ the plain run just before it (alternating), min / **median** / max over "
             "tasks × repeats. τ = tokens per target pass. Wasted verify / token = rejected draft positions "
             "verified (a cycle's first rejected one and all after it) per generated token. "
             "Acceptance: P(position i accepted | reached). "
             "Efficiency = median speedup ÷ ideal speedup of the same cycles: Σ tokens·T(1) / Σ (T_draft + T(d+1)), "
             "with T(k) from `edgespec profile` and T_draft from the drafter's cost prior (a draft model's T(1) per "
             "drafted token; a head's timed chain step or block). "
             "Draft cost = the drafter's ms per drafted token ÷ plain ms per token, measured in these runs. "
             "**Predicted memory-bound** is a prediction, not a measurement: the speedup of the same cycles "
             "if verifying k ≤ 9 tokens cost one step (T(k) = T(1)), Σ tokens / Σ (1 + d·draft cost).", ""]
    for temp in sorted({r["temperature"] for r in summary}):
        lines += [f"## temperature {temp:g}", "",
                  "| category | config | plain tok/s | spec tok/s | speedup min / med / max | τ | "
                  "wasted verify / token | efficiency | "
                  "acceptance by position | draft / verify / other | draft cost | predicted memory-bound | "
                  "peak RSS MiB | greedy mismatches |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in (r for r in summary if r["temperature"] == temp):
            eff = f"{r['efficiency']:.2f}" if r.get("efficiency") else "–"
            acc = " ".join("–" if a is None else f"{a:.2f}" for a in r["acceptance_by_position"][:8]) or "–"
            split = " / ".join(f"{r['split'][k]:.0%}" for k in ("draft", "verify", "other"))
            cost = f"{r['draft_cost_vs_t1']:.3f}" if "draft_cost_vs_t1" in r else "–"
            pred = f"{r['predicted_memory_bound']:.2f}" if "predicted_memory_bound" in r else "–"
            mism = ("**" + str(r["mismatches"]) + "**") if r["mismatches"] else ("0" if temp == 0 else "–")
            cat = f"**{r['category']}**" if r["category"] == "all" else r["category"]
            lines.append(f"| {cat} | {r['config']} | {r['plain_tok_per_s']:.1f} | {r['tok_per_s']:.1f} | "
                         f"{r['speedup_min']:.2f} / **{r['speedup_median']:.2f}** / {r['speedup_max']:.2f} | "
                         f"{r['tau']:.2f} | {r['wasted_per_token']:.2f} | {eff} | {acc} | {split} | {cost} | "
                         f"{pred} | {r['peak_rss_mb']:.0f} | {mism} |")
        lines.append("")
        lines += _auto_vs_fixed([r for r in summary if r["temperature"] == temp])
        lines += _by_turn([r for r in turns if r["temperature"] == temp])
    lines += [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def _auto_vs_fixed(rows: Sequence[dict]) -> list[str]:
    """Per category: the scheduler (k=auto) against the best fixed γ of the sweep."""
    auto = {r["category"]: r for r in rows if r["config"].endswith("k=auto")}
    fixed = [r for r in rows if is_fixed_gamma(r["config"])]
    if not auto or not fixed:
        return []
    out = ["| category | auto speedup | best fixed γ | its speedup | auto ÷ best fixed |", "|---|---|---|---|---|"]
    for cat, a in auto.items():
        best = max((r for r in fixed if r["category"] == cat), key=lambda r: r["speedup_median"], default=None)
        if best is not None:
            out.append(f"| {cat} | {a['speedup_median']:.2f} | {best['config']} | {best['speedup_median']:.2f} | "
                       f"**{a['speedup_median'] / best['speedup_median']:.2f}** |")
    return [*out, ""]


def _by_turn(rows: Sequence[dict]) -> list[str]:
    """Sessions: per config, the median speedup and τ of each turn (a drafter that remembers should
    gain as a session goes on)."""
    if not rows:
        return []
    turns = sorted({r["turn"] for r in rows})
    out = ["Sessions, by turn: median speedup (τ) over the sessions' k-th turns", "",
           "| config | " + " | ".join(f"turn {k}" for k in turns) + " |", "|---|" + "---|" * len(turns)]
    for config in dict.fromkeys(r["config"] for r in rows):
        cell = {r["turn"]: f"{r['speedup_median']:.2f} ({r['tau']:.2f})" for r in rows if r["config"] == config}
        out.append(f"| {config} | " + " | ".join(cell.get(k, "–") for k in turns) + " |")
    return [*out, ""]


def plots(out: Path, summary: Sequence[dict]) -> list[str]:
    """speedup.png (median speedup per category and config) and acceptance.png; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    names = []
    for temp in sorted({r["temperature"] for r in summary}):
        rows = [r for r in summary if r["temperature"] == temp]
        configs = sorted({r["config"] for r in rows})
        cats = sorted({r["category"] for r in rows if r["category"] != "all"}) + ["all"]
        fig, ax = plt.subplots(figsize=(7, 3.2))
        width = 0.8 / max(1, len(configs))
        for j, cfg in enumerate(configs):
            vals = [next((r["speedup_median"] for r in rows if r["config"] == cfg and r["category"] == c), 0) for c in cats]
            ax.bar([i + j * width for i in range(len(cats))], vals, width, label=cfg)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))], cats, rotation=20, fontsize=8)
        ax.set_ylabel("speedup vs plain (median)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        name = f"speedup_t{temp:g}.png"
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        fig, ax = plt.subplots(figsize=(5, 3))
        for cfg in configs:
            acc = next(r["acceptance_by_position"] for r in rows if r["config"] == cfg and r["category"] == "all")
            ax.plot(range(1, len(acc) + 1), [float("nan") if a is None else a for a in acc], marker="o", label=cfg)
        ax.set_xlabel("draft position")
        ax.set_ylabel("P(accepted | reached)")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=7)
        fig.tight_layout()
        name2 = f"acceptance_t{temp:g}.png"
        fig.savefig(out / name2, dpi=90)
        plt.close(fig)
        names += [name, name2]
    return names
