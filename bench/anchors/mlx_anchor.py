"""Anchor: edgespec's speculative generation on the MLX backend beside mlx-lm's own
`speculative_generate_step`, same converted model pair, same prompt tokens, same token budget,
greedy, in one run (alternating, so machine drift hits both alike). Prints tok/s and the ratio.

    .venv/bin/python bench/anchors/mlx_anchor.py --target gemma3-q8_0 --drafter gemma3 \
        --max-tokens 32 --num-draft 3 --prompts 2

Both loops use the very same MLX directories (GGUF files are converted once by edgespec and loaded
by mlx-lm's `load_model` as they are). Times are wall time per generation, prompt included.
On Linux these are CPU MLX numbers: they say nothing about Apple silicon.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# The first prompts of tests/real_prompts.py (plain text: the Gemma target is a base model).
PROMPTS = [
    "The history of the printing press begins",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Once upon a time, in a village between two rivers, there lived",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="gemma3-q8_0")
    ap.add_argument("--drafter", default="gemma3")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-draft", type=int, default=3, help="γ for both loops (mlx-lm's num_draft_tokens)")
    ap.add_argument("--prompts", type=int, default=2, choices=range(1, len(PROMPTS) + 1),
                    help="how many of the prompts")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()

    import mlx.core as mx
    from mlx_lm.generate import generate_step, speculative_generate_step
    from mlx_lm.utils import load_model

    import edgespec
    from edgespec.backends.mlx import mlx_model_dir
    from edgespec.bench.provenance import line, provenance
    from edgespec.models import resolve_model

    print(f"ran at: {line(provenance(REPO))}", flush=True)

    engine = edgespec.load(args.target, args.drafter, backend="mlx", n_ctx=1024, num_draft=args.num_draft)
    target, _ = load_model(mlx_model_dir(resolve_model(args.target)))
    draft, _ = load_model(mlx_model_dir(resolve_model(args.drafter)))

    def mlx_lm_run(ids: list[int]) -> tuple[list[int], float]:
        t0 = time.perf_counter()
        out = [int(t) for t, _, _ in speculative_generate_step(
            mx.array(ids), target, draft, num_draft_tokens=args.num_draft, max_tokens=args.max_tokens)]
        return out, time.perf_counter() - t0

    def mlx_lm_plain(ids: list[int]) -> tuple[list[int], float]:
        t0 = time.perf_counter()
        out = [int(t) for t, _ in generate_step(mx.array(ids), target, max_tokens=args.max_tokens)]
        return out, time.perf_counter() - t0

    def edgespec_run(ids: list[int], gamma: int | str) -> tuple[list[int], float]:
        t0 = time.perf_counter()
        g = engine.generate(ids, max_tokens=args.max_tokens, num_draft=gamma, speculative=gamma != 0)
        return g.tokens, time.perf_counter() - t0

    prompts = [engine.target.tokenize(p) for p in PROMPTS[:args.prompts]]
    mlx_lm_run(prompts[0][:4])  # warm-up: first-call allocations of both
    edgespec_run(prompts[0][:4], args.num_draft)
    edgespec_run(prompts[0][:4], "auto")  # the scheduler's one-time calibration (cached per model)
    spec = f"edgespec γ={args.num_draft}"
    rates: dict[str, list[float]] = {"mlx-lm": [], spec: [], "edgespec auto": [], "mlx-lm plain": [],
                                     "edgespec plain": []}
    same = True
    for _ in range(args.repeats):
        for ids in prompts:
            ref, t = mlx_lm_run(ids)
            rates["mlx-lm"].append(len(ref) / t)
            for key, gamma in ((spec, args.num_draft), ("edgespec auto", "auto"), ("edgespec plain", 0),
                               ("mlx-lm plain", None)):
                toks, t = mlx_lm_plain(ids) if gamma is None else edgespec_run(ids, gamma)
                rates[key].append(len(toks) / t)
                n = min(len(toks), len(ref))  # edgespec stops at end-of-generation, mlx-lm's step does not
                same &= toks[:n] == ref[:n]
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"target {args.target} · drafter {args.drafter} · {len(prompts)} prompts × {args.repeats} · "
          f"{args.max_tokens} tokens · greedy · γ={args.num_draft}")
    for key, rate in med.items():
        print(f"  {key:<16} {rate:6.2f} tok/s   ratio to mlx-lm speculative {rate / med['mlx-lm']:.2f}")
    print(f"  same greedy tokens in every run: {'yes' if same else 'NO'}")
    print("  (Linux CPU MLX: these numbers say nothing about Apple silicon)")


if __name__ == "__main__":
    main()
