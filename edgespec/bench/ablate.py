"""Ablate the scheduler's tunables on the replay: what each one buys, in the replay's numbers.

Every variant changes one tunable of edgespec.schedule (most often: switches its mechanism off) and
replays `-k auto` over every trace set (chains included) on every device. A cell is one (device,
trace set, -k auto policy, category): its speedup over plain. For each variant the report gives,
against today's scheduler, the smallest and largest cell change, the geometric mean change, how many cells got
better or worse by more than 1%, the cell that moved most, and whether the regression gate
(replay.check) still passes. A tunable whose variants change no cell by more than 1% buys nothing
the replay can see.

    .venv/bin/python -m edgespec.bench.ablate --traces tests/fixtures/traces --device all
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
from collections.abc import Iterator
from typing import Any

from edgespec import calibration
from edgespec.bench import replay, simulate
from edgespec.schedule import acceptance, costs, scheduler

# name -> [(module, attribute, value)]: what the variant sets
VARIANTS: dict[str, list[tuple[Any, str, Any]]] = {
    "no probes after the first try (PROBE_SHARE 0)": [(scheduler, "PROBE_SHARE", 0.0)],
    "probes 4x (PROBE_SHARE 1)": [(scheduler, "PROBE_SHARE", 1.0)],
    "pessimistic prior (PRIOR 0.3)": [(acceptance, "PRIOR", 0.3)],
    "optimistic prior (PRIOR 0.7)": [(acceptance, "PRIOR", 0.7)],
    "prior worth 1 position (STRENGTH 1)": [(acceptance, "STRENGTH", 1.0)],
    "pair record: the newest generation only (PAIR_DECAY 0)": [(calibration, "PAIR_DECAY", 0.0)],
    "recent rate = last outcome (RECENT 1)": [(acceptance, "RECENT", 1.0)],
    "no recent cap (RECENT 0)": [(acceptance, "RECENT", 0.0)],
    "no slow start (SLOW_START 31)": [(scheduler, "SLOW_START", costs.K_MAX - 1)],
    "costly drafters to 31 (COSTLY_GAMMA 31)": [(scheduler, "COSTLY_GAMMA", costs.K_MAX - 1)],
    "costly drafters to 8 (COSTLY_GAMMA 8)": [(scheduler, "COSTLY_GAMMA", 8)],
    "cost fit unweighted (FIT_WEIGHT_CAP 1)": [(costs, "FIT_WEIGHT_CAP", 1)],
}


@contextlib.contextmanager
def patched(changes: list[tuple[Any, str, Any]]) -> Iterator[None]:
    saved = [(m, a, getattr(m, a)) for m, a, _ in changes]
    try:
        for m, a, v in changes:
            setattr(m, a, v)
        yield
    finally:
        for m, a, v in saved:
            setattr(m, a, v)


def auto_cells(sets: list, devices: list) -> tuple[dict[tuple[str, str, str, str], float], dict]:
    """{(device, trace set, policy, category): its speedup over plain} for each -k auto policy
    (replay.AUTO: a pair's first run and a pair run before), and the results the gate reads."""
    cells, results = {}, {}
    for dev in devices:
        res: dict[str, dict[str, list]] = {}
        for ts in sets:
            if ts.kind in dev.draft:
                tasks = [simulate.prepare(t, ts.temperature) for t in ts.traces]
                res[replay.set_name(ts)] = simulate.run_autos([(ts, tasks)], dev)
        for ch in replay.chains_of(sets):
            if all(ts.kind in dev.draft for ts in ch):
                r = replay.replay_chain(ch, dev)
                res[replay.chain_name(ch)] = {p: r[p] for p in replay.AUTO}
        results[dev.name] = res
        for name, r in res.items():
            for p in replay.AUTO:
                for cat, rs in replay.by_category(r[p]).items():
                    cells[dev.name, name, p, cat] = replay.total(rs)
    return cells, results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", action="append", help="trace directory or file (default tests/fixtures/traces)")
    ap.add_argument("--device", action="append", help="'all', a bundled name or a file (repeatable)")
    ap.add_argument("--only", action="append", help="run only variants whose name contains this")
    args = ap.parse_args(argv)
    from edgespec.bench.devices import bundled, load_device

    sets = [ts for p in (args.traces or ["tests/fixtures/traces"]) for ts in replay.load_sets(p)]
    devices = [load_device(d) for s in (args.device or ["all"]) for d in (bundled() if s == "all" else [s])]
    base, base_res = auto_cells(sets, devices)
    print(f"today: {len(base)} cells, median {statistics.median(base.values()):.3f}x plain, "
          f"min {min(base.values()):.3f}; gate: {'pass' if not replay.check(base_res) else 'FAIL'}\n")
    print("| variant | cell change: min / max | geo-mean change | cells ±1%: better / worse | "
          "largest change (today → variant) | gate |")
    print("|---|---|---|---|---|---|")
    for name, changes in VARIANTS.items():
        if args.only and not any(o in name for o in args.only):
            continue
        with patched(changes):
            cells, res = auto_cells(sets, devices)
        rel = {k: cells[k] / base[k] - 1 for k in base}
        worst = max(rel, key=lambda k: abs(rel[k]))
        fails = replay.check(res)
        geo = math.exp(statistics.fmean(math.log1p(r) for r in rel.values())) - 1
        up, down = sum(r > 0.01 for r in rel.values()), sum(r < -0.01 for r in rel.values())
        print(f"| {name} | {min(rel.values()):+.1%} / {max(rel.values()):+.1%} | {geo:+.2%} | {up} / {down} | "
              f"{' '.join(worst)}: {base[worst]:.3f} → {cells[worst]:.3f} | {'pass' if not fails else f'FAIL ({len(fails)})'} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
