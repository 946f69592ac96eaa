"""Greedy verification with the rows handed over (eval rows="all": llama.cpp's buffer copied into a
new array, then verify_greedy) against Backend.eval_argmax (the argmax read in llama.cpp's own
output buffer, no copy; then accept_greedy over the γ+1 ids), paired.

    .venv/bin/python bench/greedy_argmax.py --repeats 41 --out bench/results/host/greedy-argmax.md

Per model and γ: the wall time of one verification forward of γ+1 tokens after a 96-token context,
all drafts accepted (the longest cycle), the two ways alternated; and the host's share of it (the
time after the forward returns: verify_greedy over the copied rows, or accept_greedy over the ids;
with eval_argmax the argmax itself is inside the call, so compare the totals).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from edgespec.backends.llama_cpp import LlamaCppBackend
from edgespec.bench.provenance import line, provenance
from edgespec.verify import accept_greedy, verify_greedy

MODELS = {"49k SmolLM2 Q4_1": "SmolLM2-135M-Instruct.Q4_1.gguf", "262k Gemma-3 Q4_K_M": "gemma-3-270m-q4_k_m.gguf"}
CONTEXT = "The history of the printing press begins with movable type, which changed how books were made. " * 5


def time_pair(b: LlamaCppBackend, base: int, toks: list[int], repeats: int) -> dict[str, float]:
    """Medians (ms) of the forward + verification, and of the verification alone, both ways."""
    draft = toks[1:]
    out: dict[str, list[float]] = {k: [] for k in ("host", "host_verify", "backend", "backend_verify")}
    for r in range(repeats + 2):  # two warm-ups (the first of each re-plans llama.cpp's graph)
        for way in (("host", "backend") if r % 2 else ("backend", "host")):
            b.truncate(base)
            t0 = time.perf_counter()
            if way == "host":
                rows = b.eval(toks, rows="all")
                t1 = time.perf_counter()
                verify_greedy(rows, draft)
            else:
                ids = b.eval_argmax(toks)
                t1 = time.perf_counter()
                accept_greedy(ids, draft)
            t2 = time.perf_counter()
            if r >= 2:
                out[way].append(t2 - t0)
                out[way + "_verify"].append(t2 - t1)
    return {k: 1000 * float(np.median(v)) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=41)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gammas", default="0,4,8")
    ap.add_argument("--models", type=Path, default=Path(os.environ.get("EDGESPEC_HOME", Path.home() / ".cache/edgespec"))
                    / "models")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    lines = ["| model | γ | eval rows=all + verify_greedy | eval_argmax + accept_greedy | ratio | host after the forward: verify_greedy "
             "| accept_greedy |", "|---|---|---|---|---|---|---|"]
    for name, file in MODELS.items():
        path = args.models / file
        if not path.exists():
            print(f"skipping {name}: {path} not fetched (edgespec models fetch)")
            continue
        with LlamaCppBackend(path, n_ctx=512, threads=args.threads) as b:
            ctx = b.tokenize(CONTEXT)[:96]
            b.eval(ctx, rows="none")
            for g in (int(x) for x in args.gammas.split(",")):
                toks = b.tokenize(" the quick brown fox jumps over the lazy dog and runs", add_special=False)[:g + 1]
                t = time_pair(b, len(ctx), toks, args.repeats)
                lines.append(f"| {name} | {g} | {t['host']:.3f} | {t['backend']:.3f} | {t['backend'] / t['host']:.3f} "
                             f"| {t['host_verify']:.3f} | {t['backend_verify']:.4f} |")
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(f"    .venv/bin/python bench/greedy_argmax.py --repeats {args.repeats} --threads "
                            f"{args.threads} --gammas {args.gammas}\n\n{line(provenance())}\n\n"
                            f"ms, medians of {args.repeats} alternated pairs\n\n"
                            + text)


if __name__ == "__main__":
    main()
