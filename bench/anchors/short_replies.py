"""Short replies against native llama.cpp: what a generation pays besides its forward passes (#23).

For chat prompts whose greedy replies are a few tokens long, each repeat runs, back to back and in
alternating order: native `llama-speculative-simple` plain (a drafter that never matches), edgespec
plain and edgespec `-k auto` (n-gram), all greedy on the same prompt tokens, threads and context.

Counted over the same window on both sides:
- tokens: every token the target produced, the end-of-generation token included (the native loop
  counts it; edgespec does not emit it, so its count gets it back here);
- time: native's "decoded … in S seconds" (after the prompt, through the last token); edgespec's
  `Stats.t_window`, the wall time from the end of its prompt evaluation to the last chunk (every
  cycle, the loop's bookkeeping, detokenizing, the consumer's share). Each row also keeps what the
  `Engine.chat` call spent outside the prompt and the window ("setup_ms": template rendering and
  tokenizing, which native does before its window too), printed beside the table.

    .venv/bin/python bench/anchors/short_replies.py --target smollm2 --repeats 8 --out FILE.json

Prints one table (medians of the per-pair ratios) and writes every row to FILE.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.anchors.native import find_binary, native_flags, parse_output, render  # noqa: E402

# held out: not in the bench suite; greedy replies of SmolLM2-135M-Instruct run 2–16 tokens
PROMPTS = [
    "What is the capital of France? Answer with one word.",
    "Reply with the word yes.",
    "What is 2 + 3? Answer with a number only.",
    "Name one primary colour.",
    "Say hello in French.",
    "What colour is the sky on a clear day? One word.",
    "Give me a synonym for happy.",
    "Translate 'cat' into Spanish.",
]


def run_native(binary: Path, flags: list[str], prompt: tuple, max_tokens: int, tmp: Path) -> dict:
    """One native plain run: tokens (EOS included) and seconds of its decode window."""
    import subprocess

    pfile = tmp / "prompt.txt"
    pfile.write_text(prompt[2] + "\n", encoding="utf-8")  # -f drops one trailing newline
    proc = subprocess.run([str(binary), *flags, "-f", str(pfile), "-n", str(max_tokens - 1)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300, check=False)
    if proc.returncode != 0:
        sys.exit(f"{binary.name} exited {proc.returncode}:\n{proc.stdout.decode()[-2000:]}")
    r = parse_output(proc.stdout.decode("utf-8", "replace"))
    return dict(n_tokens=r["n_tokens"], seconds=r["decode_s"])


def run_edgespec(engine, messages: list[dict], max_tokens: int, speculative: bool) -> dict:
    """One edgespec run from a cold cache: tokens (EOS included), seconds of its decode window, and
    what the call spent outside the window and the prompt (ms)."""
    engine.reset()
    t0 = time.perf_counter()
    gen = engine.chat(messages, max_tokens=max_tokens, temperature=0.0, speculative=speculative)
    wall = time.perf_counter() - t0
    s = gen.stats
    return dict(n_tokens=s.n_tokens + (gen.finish_reason == "eos"), seconds=s.t_window,
                setup_ms=(wall - s.t_prefill - s.t_window) * 1000, cycles=s.n_cycles, tokens=gen.tokens)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2", help="target GGUF path or model name (default smollm2)")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--bin", help="path to llama-speculative-simple (default: the one build.sh made)")
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args(argv)

    from edgespec.api import load
    from edgespec.bench.provenance import provenance
    from edgespec.models import resolve_model

    binary = find_binary(args.bin)
    target = str(Path(resolve_model(args.target)).resolve())
    opts = SimpleNamespace(threads=args.threads, ctx=args.ctx, ubatch=512, kv_type="q8_0", native_defaults=False,
                           ngram_n=3)
    flags = native_flags(opts, target, "ngram", 0)
    engine = load(target, "ngram", n_ctx=args.ctx, threads=args.threads, num_draft="auto")
    tasks = [SimpleNamespace(messages=({"role": "user", "content": p},)) for p in PROMPTS]
    prompts = [render(engine, t, chat=True) for t in tasks]
    if not all(p[3] for p in prompts):
        sys.exit("native prompt tokens differ from edgespec's")
    engine.chat(list(tasks[0].messages), max_tokens=4)  # calibration and warm-up, outside the pairs
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgespec-short-") as tmp:
        for rep in range(args.repeats):
            for i, (task, prompt) in enumerate(zip(tasks, prompts)):
                order = ["native", "plain", "auto"]
                if (rep + i) % 2:
                    order.reverse()  # alternate: drift moves both sides of a pair alike
                row = dict(prompt=i, repeat=rep)
                for what in order:
                    if what == "native":
                        row[what] = run_native(binary, flags, prompt, args.max_tokens, Path(tmp))
                    else:
                        row[what] = run_edgespec(engine, list(task.messages), args.max_tokens, what == "auto")
                assert row["plain"]["tokens"] == row["auto"]["tokens"], "greedy -k auto differs from plain"
                rows.append(row)
                rate = {w: row[w]["n_tokens"] / row[w]["seconds"] for w in order}
                print(f"prompt {i} rep {rep}: {row['native']['n_tokens']:>2} tok  native {rate['native']:6.1f}  "
                      f"plain {rate['plain']:6.1f}  auto {rate['auto']:6.1f} tok/s", flush=True)
    engine.close()

    def ratio(rows: list[dict], what: str) -> float:
        return statistics.median((r[what]["n_tokens"] / r[what]["seconds"])
                                 / (r["native"]["n_tokens"] / r["native"]["seconds"]) for r in rows)

    med = statistics.median
    print("\n| replies | pairs | native plain tok/s | edgespec plain tok/s | edgespec -k auto tok/s | "
          "plain ÷ native | auto ÷ native |")
    print("|---|---|---|---|---|---|---|")
    print(f"| ≤ {args.max_tokens} tokens (median {med(r['native']['n_tokens'] for r in rows)}) | {len(rows)} | "
          + " | ".join(f"{med(r[w]['n_tokens'] / r[w]['seconds'] for r in rows):.1f}" for w in ("native", "plain", "auto"))
          + f" | **{ratio(rows, 'plain'):.3f}** | **{ratio(rows, 'auto'):.3f}** |")
    meta = dict(binary=str(binary), target=target, threads=args.threads, ctx=args.ctx, max_tokens=args.max_tokens,
                native_command=" ".join([str(binary), *flags, "-f", "PROMPT", "-n", str(args.max_tokens - 1)]),
                machine=f"{platform.platform()}, {os.cpu_count()} CPUs", **provenance(REPO),
                prompts=PROMPTS)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"edgespec outside the window (template, tokenizing, setup): median "
          f"{med(r['plain']['setup_ms'] for r in rows):.2f} ms plain, {med(r['auto']['setup_ms'] for r in rows):.2f} ms auto")
    print(f"wrote {args.out} ({len(rows)} pairs)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
