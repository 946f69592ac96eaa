"""Where a draft-model cycle's milliseconds go: the forwards of one γ = 3 cycle, timed alone and in
the order a cycle runs them (drafter and target contexts alternating), medians over repeats.

    .venv/bin/python bench/cycle_ops.py --target smollm2-f32 --drafter smollm2 [--repeats 15]

d1 / d2: the drafter's forward over 1 / 2 tokens (a cycle's first step reads the previous cycle's
last draft and the bonus token); t1 / t4: the target's forward over 1 / 4 tokens with all logit
rows (verification of γ = 3). Each op runs after 64 cached tokens and is cut back after.
"""

from __future__ import annotations

import argparse
import statistics
import time

from edgespec.backends.llama_cpp import LlamaCppBackend
from edgespec.bench.provenance import line, provenance
from edgespec.models import resolve_model

CACHED = 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    print(f"ran at: {line(provenance())}", flush=True)
    target = LlamaCppBackend(resolve_model(args.target), n_ctx=1024, threads=args.threads)
    drafter = LlamaCppBackend(resolve_model(args.drafter), n_ctx=1024, threads=args.threads)
    prefix = list(range(1000, 1000 + CACHED))
    target.eval(prefix, rows="none")
    drafter.eval(prefix, rows="none")
    times: dict[str, list[float]] = {}

    def timed(name: str, fn) -> None:
        t0 = time.perf_counter()
        fn()
        times.setdefault(name, []).append((time.perf_counter() - t0) * 1000)

    for _ in range(args.repeats):
        for name, backend, tokens, rows in (("d1 alone", drafter, [5], "last"), ("d2 alone", drafter, [5, 6], "last"),
                                            ("t1 alone", target, [5], "all"), ("t4 alone", target, [5, 6, 7, 8], "all")):
            timed(name, lambda b=backend, t=tokens, r=rows: b.eval(t, rows=r))
            backend.truncate(CACHED)
        # one cycle, in order: the drafter's first step (2 tokens), two more steps, verification
        timed("d2 after the target", lambda: drafter.eval([5, 6], rows="last"))
        timed("d1 after the drafter", lambda: drafter.eval([7], rows="last"))
        timed("d1 after the drafter", lambda: drafter.eval([8], rows="last"))
        timed("t4 after the drafter", lambda: target.eval_argmax([5, 6, 7, 8]))
        drafter.truncate(CACHED)
        target.truncate(CACHED)
    for name, v in times.items():
        print(f"{name:22s} {statistics.median(v):7.2f} ms")
    target.close()
    drafter.close()


if __name__ == "__main__":
    main()
