"""What the history drafter costs: index memory per token and drafting time per call, with 1M tokens
of history (issue #33: "memory of the index per 1M history tokens; drafting time per token").

    .venv/bin/python bench/history_cost.py [--tokens 1000000] [--model GGUF] --out bench/results/history-cost

Two histories: synthetic Zipf-distributed token ids (50k vocabulary; requests of ~2k tokens that
quote earlier ones: close to the worst case for a suffix automaton's size) and real text (every
prompt of the shipped suite, Spec-Bench and the session suites, tokenized by the target's
tokenizer, repeated with a different request order until the budget). Memory is what tracemalloc
sees allocated by the index; time is wall-clock on this machine (run it alone: another process on
the 2 cores doubles it). Writes results.json and results.md to --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from edgespec.bench.provenance import line as provenance_line  # noqa: E402
from edgespec.bench.provenance import provenance  # noqa: E402
from edgespec.drafters.history import HistoryDrafter  # noqa: E402
from edgespec.sampling import SamplingParams  # noqa: E402

G = SamplingParams()


def zipf_requests(n_tokens: int, seed: int = 0) -> list[list[int]]:
    rnd = random.Random(seed)

    def zipf(n: int) -> list[int]:
        return [min(int(rnd.paretovariate(1.0)), 49_999) for _ in range(n)]

    docs: list[list[int]] = []
    while sum(map(len, docs)) < n_tokens:
        quote: list[int] = []
        if docs:
            src = rnd.choice(docs)
            a = rnd.randrange(len(src) - 400)
            quote = src[a: a + 400]
        docs.append(zipf(1200) + quote + zipf(400))
    return docs


def real_requests(model: str, n_tokens: int, seed: int = 0) -> list[list[int]]:
    """Every prompt text edgespec ships, tokenized by `model`'s tokenizer, shuffled and repeated."""
    from llama_cpp import Llama

    texts = []
    for f in sorted((REPO / "edgespec" / "bench").rglob("*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            if line.strip():
                texts.append(line)  # the JSON line itself: prompts, messages, schemas
    vocab = Llama(model_path=model, vocab_only=True, verbose=False)
    base = [vocab.tokenize(t.encode(), add_bos=False, special=False) for t in texts]
    rnd, docs = random.Random(seed), []
    while sum(map(len, docs)) < n_tokens:
        order = base[:]
        rnd.shuffle(order)
        docs += order
    return docs


def measure(docs: list[list[int]], n_tokens: int) -> dict:
    docs = list(docs)
    while sum(map(len, docs[:-1])) > n_tokens:
        docs.pop(0)
    probe = docs.pop()  # the "current request": not in the history
    rng = np.random.default_rng(0)

    def build() -> tuple[HistoryDrafter, float]:
        d = HistoryDrafter(max_tokens=int(n_tokens * 1.5) + 10_000)
        t = time.perf_counter()
        for doc in docs:
            d.draft(doc, 0, G, rng)
            d.reset()
        return d, time.perf_counter() - t

    tracemalloc.start()  # slows allocation down: the time comes from a second build without it
    d, _ = build()
    mem, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del d
    d, t_index = build()
    indexed = d.indexed
    ctx = probe[: len(probe) // 2]
    d.draft(ctx, 16, G, rng)
    calls, lookups, drafted = [], [], 0
    for tok in probe[len(probe) // 2:]:
        ctx.append(tok)
        t = time.perf_counter()
        drafted += len(d.draft(ctx, 16, G, rng).tokens)
        calls.append(time.perf_counter() - t)
        t = time.perf_counter()
        d.draft(ctx, 16, G, rng)  # nothing new to index: the lookup and walk alone
        lookups.append(time.perf_counter() - t)
    return {"history_tokens": indexed, "documents": len(docs), "index_bytes": mem,
            "bytes_per_token": mem / indexed, "mib_per_1m_tokens": mem / indexed * 1e6 / 2**20,
            "index_us_per_token": 1e6 * t_index / indexed,
            "call_us_median": 1e6 * statistics.median(calls), "call_us_p90": 1e6 * sorted(calls)[len(calls) * 9 // 10],
            "lookup_us_median": 1e6 * statistics.median(lookups), "calls": len(calls),
            "drafted_per_call": drafted / len(calls), "context_tokens": len(ctx)}


def table(results: dict, args: argparse.Namespace, prov: dict) -> str:
    rows = ["| history | tokens indexed | MiB per 1M tokens | bytes/token | index µs/token | call µs (median, p90) | lookup µs | drafted/call |",
            "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        rows.append(f"| {name} | {r['history_tokens']:,} | {r['mib_per_1m_tokens']:.0f} | {r['bytes_per_token']:.0f} | "
                    f"{r['index_us_per_token']:.1f} | {r['call_us_median']:.1f}, {r['call_us_p90']:.1f} | "
                    f"{r['lookup_us_median']:.1f} | {r['drafted_per_call']:.1f} |")
    return ("# History drafter: memory and drafting time\n\n"
            f"`.venv/bin/python bench/history_cost.py --tokens {args.tokens}` ({provenance_line(prov)}, "
            f"Python {platform.python_version()}, alone on the machine).\n"
            "A call = index the one new context token + draft up to 16 (what the engine does per plain step "
            "or cycle), in the second half of a request whose history is all the others; lookup = the "
            "same call with nothing new to index.\n\n" + "\n".join(rows) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1_000_000, help="history tokens to index")
    ap.add_argument("--model", default=str(Path.home() / ".cache/edgespec/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
                    help="GGUF whose tokenizer makes the real-text history")
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/history-cost")
    args = ap.parse_args()
    results = {}
    print("synthetic (Zipf) history...", file=sys.stderr)
    results["synthetic Zipf, requests quoting earlier ones"] = measure(zipf_requests(args.tokens), args.tokens)
    print("real-text history...", file=sys.stderr)
    results["real text (edgespec's prompt suites)"] = measure(real_requests(args.model, args.tokens), args.tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    prov = provenance(REPO)
    (args.out / "results.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                       "provenance": prov, "results": results}, indent=1))
    md = table(results, args, prov)
    (args.out / "results.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
