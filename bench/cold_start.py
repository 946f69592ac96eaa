"""What a new user's first generation loses to pricing (issue #30): load → price → one generation, each
in a fresh process: with an empty profiles directory ("new machine": no cost profile, no pair
record), with only the target's profile ("new drafter": the target was used before, with n-gram),
again with what the new-machine run left ("warm"), and plainly (no drafter, nothing to price).
Rounds run the four in turn; medians over rounds.

    .venv/bin/python bench/cold_start.py --target smollm2-f32 --drafter smollm2 [--rounds 3] [--task chat-01]

Each run reports its load (opening the models: a draft model's KV handoff is settled there), price
(what the CLI does at load: price_engine(learn=True), which times only a target whose profile is
cached, #48), generation time, and idle (the timing an unprofiled target gets after its plain first
reply, which the user does not wait for: not in the totals). "÷ warm" is load + price +
generation over the same warm: what a first generation loses to calibration (issue #30's goal for a
new drafter: ≤ 1.10); "vs plain" is plain's load + generation over it. The models come from the
usual $EDGESPEC_HOME/models (linked into a temporary home); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(args: argparse.Namespace) -> None:
    from edgespec.bench.tasks import load_tasks
    from edgespec.session import load, price_engine

    task = next(t for t in load_tasks() if t.id == args.task)
    drafter = None if args.drafter == "none" else args.drafter
    t0 = time.perf_counter()
    engine = load(args.target, drafter, n_ctx=args.ctx, threads=args.threads)
    t1 = time.perf_counter()
    price_engine(engine, learn=True)
    t2 = time.perf_counter()
    gen = engine.chat(list(task.messages), max_tokens=args.max_tokens, temperature=args.temp, seed=1)
    t3 = time.perf_counter()
    engine.wait_priced()  # the idle timing after an unprofiled target's first reply (the next run's profile)
    idle = time.perf_counter() - t3
    prior = next(iter(engine.pricing.draft_cost.values()), None)
    engine.close()
    print(json.dumps(dict(load=t1 - t0, price=t2 - t1, gen=t3 - t2, idle=idle, tokens=len(gen.tokens), tau=gen.stats.tau,
                          text=gen.text, cycles=gen.stats.cycles[:12],
                          draft_ms=prior and [round(prior.fixed_ms, 1), round(prior.per_token_ms, 1)])))


def run(args: argparse.Namespace, home: Path, drafter: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--target", args.target, "--drafter", drafter, "--task", args.task,
           "--max-tokens", str(args.max_tokens), "--temp", str(args.temp), "--ctx", str(args.ctx),
           "--threads", str(args.threads)]
    out = subprocess.run(cmd, env={**os.environ, "EDGESPEC_HOME": str(home)}, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-f32")
    ap.add_argument("--drafter", default="smollm2")
    ap.add_argument("--task", default="chat-01", help="a shipped-suite task id (its chat messages)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    from edgespec.bench.provenance import line, provenance
    from edgespec.models import model_home

    print(f"ran at: {line(provenance())}", flush=True)

    kinds = ("new machine", "new drafter", "warm", "plain")
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
            cold, known = Path(a), Path(b)
            for home in (cold, known):
                (home / "models").symlink_to(model_home().resolve())
            run(args, known, "ngram")  # prices the target only: what a user of the target already has
            for kind, home, drafter in (("new machine", cold, args.drafter), ("new drafter", known, args.drafter),
                                        ("warm", cold, args.drafter), ("plain", cold, "none")):
                res = run(args, home, drafter)
                runs[kind].append(res)
                print(f"round {r + 1} {kind:11s} load {res['load']:.2f} s  price {res['price']:.2f} s  "
                      f"gen {res['gen']:.2f} s  idle {res['idle']:.2f} s  ({res['tokens']} tokens, tau {res['tau']:.2f}; draft prior "
                      f"{res['draft_ms']} ms; first cycles {res['cycles']})", flush=True)

    def med(kind: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[kind])

    def first(kind: str) -> float:  # opening, pricing and the generation: what the user waits for
        return statistics.median(x["load"] + x["price"] + x["gen"] for x in runs[kind])

    print(f"\n{args.target} + {args.drafter}, {args.task}, {args.max_tokens} tokens, T {args.temp}, "
          f"{args.rounds} rounds (medians; load + price + generation, s)")
    print(f"{'':12s} {'load':>6s} {'price':>6s} {'gen':>6s} {'total':>6s} {'÷ warm':>7s} {'vs plain':>8s}")
    for kind in kinds:
        print(f"{kind:12s} {med(kind, 'load'):6.2f} {med(kind, 'price'):6.2f} {med(kind, 'gen'):6.2f} "
              f"{first(kind):6.2f} {first(kind) / first('warm'):7.2f} {first('plain') / first(kind):8.2f}")
    same = all(x["text"] == runs["plain"][0]["text"] for k in runs for x in runs[k])
    print(f"every text equal to plain's: {same}")


if __name__ == "__main__":
    main()
