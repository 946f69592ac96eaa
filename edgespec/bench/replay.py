"""Replay plain greedy generations through n-gram drafting policies with modeled costs: no noise.

Each bench task is generated once, greedy and plain, through the target. Every policy is then
replayed over that output: the n-gram drafter drafts from the true context, verification accepts
the longest prefix equal to the output (exactly what greedy verification does), and a cycle that
verifies γ drafts costs T(γ+1) from the target's cost profile (n-gram drafting is free), plus the
attention each verified token pays for the tokens cached before it: the profile times forwards
after 64 cached tokens, and llama.cpp's CPU flash attention adds a cost per query token and cached
token (measured at start, `--ctx-us`) that batching does not share. Policies:

- auto: the real `Scheduler`, given the profile's costs (and the context cost, as the engine's)
  and the replayed cycles' modeled times;
- k=N: a fixed γ (edgespec's n-gram drafter, n-gram sizes 4 down to 2);
- native-N: llama.cpp's ngram-simple as `llama-speculative-simple` runs it (one 3-gram lookup,
  drafts only with at least 3 tokens to copy, then up to N);
- oracle: the best γ for every cycle knowing the output (a dynamic program over positions), the
  ceiling of this drafter at these costs.

Speedup = Σ T(1, context) over the tokens / Σ T(γ+1, context) over the cycles, with
T(k, c) = T(k) + k · ctx_us · (c − 64). It is a model without the machine's noise, so policies
compare exactly; `--ctx-us 0` drops the context term (T(k) as profiled).

    .venv/bin/python -m edgespec.bench.replay --target smollm2 --per-category 10 --max-tokens 96

A research tool beside `edgespec bench` (tests/test_replay.py checks the policies and the oracle);
nothing in the runtime imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Callable, Sequence

import numpy as np

from edgespec.calibration import CONTEXT_TOKENS as PROFILE_CONTEXT
from edgespec.drafters.base import Draft
from edgespec.drafters.ngram import NgramDrafter
from edgespec.sampling import SamplingParams
from edgespec.schedule.scheduler import K_MAX, CostModel, Scheduler

GREEDY = SamplingParams()
Policy = Callable[[list[int], int], list[int]]  # (context, most drafts allowed) -> draft


def true_costs(t: Sequence[float], ctx_ms: float = 0.0) -> CostModel:
    """The replay's true costs: a cost model that observes nothing, so T(k, c) is the profile's T(k)
    (index 0 unused) plus the attention each query token pays per cached token (batches do not share it)."""
    return CostModel({k: t[k] for k in range(1, len(t))}, ctx_ms=ctx_ms, base_context=PROFILE_CONTEXT)


def plain_ms(c: CostModel, context: int, n: int) -> float:
    """ms for plain decoding to emit n tokens after `context` cached ones."""
    return sum(c.t_verify(context + i)[1] for i in range(n))


@dataclasses.dataclass
class Generation:
    """A task's prompt ids, its plain greedy output and budget (eos: the output ended the text)."""

    id: str
    category: str
    prompt: list[int]
    output: list[int]
    max_tokens: int
    eos: bool = False


def fixed(k: int) -> Policy:
    drafter = NgramDrafter()
    return lambda ctx, most: drafter.draft(ctx, min(k, most), GREEDY, None).tokens if most else []


def native(n_max: int, n: int = 3) -> Policy:
    """common_ngram_simple_draft (llama.cpp common/ngram-map.cpp), for context = tokens + [sampled]."""
    def draft(ctx: list[int], most: int) -> list[int]:
        L = len(ctx)
        if L - 1 <= n + n_max + 1 or most == 0:
            return []
        pattern = ctx[L - n:]
        for j in range(L - n - 2, 0, -1):  # latest match first, position 0 ignored, as native
            if ctx[j:j + n] == pattern:
                copy = min(n_max, L - 1 - (j + n))
                return ctx[j + n: j + n + copy][:most] if copy >= n else []
        return []
    return draft


def replay(g: Generation, t: Sequence[float] | CostModel, policy: Policy | Scheduler) -> tuple[float, list[tuple[int, int]]]:
    """Modeled speedup of one policy over one generation, and its (γ, accepted) cycles. A Scheduler
    keeps what it learned from one generation to the next, as the engine's does (its prior is the
    profile; it observes the modeled times)."""
    c = t if isinstance(t, CostModel) else true_costs(t)
    truth = g.output + ([-1] if g.eos else [])  # -1: the end-of-text token, never drafted
    kv, pending, done, cost, cycles = g.prompt[:-1], g.prompt[-1], 0, 0.0, []
    sched, drafter = (policy, NgramDrafter()) if isinstance(policy, Scheduler) else (None, None)
    rng = np.random.default_rng(0)  # unused by the n-gram drafter; the Drafter protocol takes one
    if sched:
        sched.new_generation(len(g.prompt))
    while done < len(truth):
        most = max(0, min(K_MAX - 1, g.max_tokens - done - 1))
        if sched:
            d = sched.draft(drafter, kv + [pending], most, GREEDY, rng)[0] if most else Draft([])
            x = d.tokens[:most]
        else:
            x = policy(kv + [pending], most)
        n = 0
        while n < len(x) and done + n < len(truth) and x[n] == truth[done + n]:
            n += 1
        emitted = truth[done: done + n + 1]
        ms = c.t_verify(len(kv))[len(x) + 1]
        cost += ms
        if sched:
            sched.observe(d, n, 0.0, ms / 1000, len(kv))
            sched.emitted(emitted)
        kv += [pending, *x[:n]]
        pending, done = emitted[-1], done + len(emitted)
        cycles.append((len(x), n))
    return plain_ms(c, len(g.prompt) - 1, min(len(g.output), g.max_tokens)) / cost, cycles


def oracle(g: Generation, t: Sequence[float] | CostModel) -> float:
    """The best modeled speedup with the n-gram drafter if every γ were chosen knowing the output."""
    c = t if isinstance(t, CostModel) else true_costs(t)
    truth = g.output + ([-1] if g.eos else [])
    drafter, N = NgramDrafter(), len(truth)
    offers = []  # per position: (draft length on offer, how many of it are right)
    for p in range(N):
        d = drafter.draft(g.prompt + truth[:p], K_MAX - 1, GREEDY, None).tokens
        right = 0
        while right < len(d) and p + right < N and d[right] == truth[p + right]:
            right += 1
        offers.append((len(d), right))
    best, kv0 = [0.0] * (N + 1), len(g.prompt) - 1  # best[p]: least cost to emit truth[p:]
    for p in range(N - 1, -1, -1):
        n_draft, right = offers[p]
        best[p] = min(c.t_verify(kv0 + p)[gam + 1] + best[min(N, p + min(gam, right) + 1)]
                      for gam in range(min(n_draft, g.max_tokens - p - 1, K_MAX - 1) + 1))
    return plain_ms(c, kv0, min(len(g.output), g.max_tokens)) / best[0]


def costs(t_forward_ms: dict[int, float]) -> list[float]:
    """T(k) for k = 0..K_MAX as the scheduler's cost model reads the profile (index 0 unused)."""
    return list(CostModel(t_forward_ms).prior)


def generations(target: str, per_category: int, max_tokens: int | None,
                measure_context: bool = True) -> tuple[list[Generation], dict, float]:
    """Plain greedy outputs of the first `per_category` tasks of each category, the target's
    profile T(k), and (measure_context) its attention cost per query and cached token (else 0)."""
    from edgespec.api import load
    from edgespec.bench.tasks import load_tasks

    engine = load(target, drafter=None)
    engine.calibrate()
    chat = engine.target.metadata("tokenizer.chat_template") is not None
    out, seen = [], {}
    for task in load_tasks():
        if seen.setdefault(task.category, 0) >= per_category:
            continue
        seen[task.category] += 1
        if chat:
            text, add_bos = engine.chat_prompt(list(task.messages))
            ids = engine.target.tokenize(text, add_bos, True)
        else:
            ids = engine.target.tokenize(task.prompt, True, False)
        budget = min(task.max_tokens, max_tokens or task.max_tokens)
        engine.reset()
        gen = engine.generate(ids, max_tokens=budget, temperature=0.0, speculative=False)
        out.append(Generation(task.id, task.category, ids, gen.tokens, budget, gen.finish_reason == "eos"))
        print(f"{task.id}: {len(gen.tokens)} tokens", file=sys.stderr)
    costs = engine.costs
    assert costs is not None, 'engine.calibrate() runs before the replays'
    t_forward = costs.t_forward_ms
    if measure_context:  # what the engine's scheduler uses too (cached in the profile), timed carefully
        from edgespec.calibration import context_cost

        print("timing what each cached token costs ...", file=sys.stderr)
        ctx_ms = context_cost(engine.target, costs.exact_batch, far=768, repeats=9, refresh=True)
    else:
        ctx_ms = 0.0
    engine.close()
    return out, t_forward, ctx_ms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--per-category", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("-k", type=int, action="append", help="fixed γ to replay (repeatable; default 4, 8, 12)")
    ap.add_argument("--ctx-us", type=float, help="attention cost in µs per query token and cached token "
                    "(default: measured; 0: T(k) as profiled, whatever the context)")
    args = ap.parse_args(argv)
    gens, t_forward, ctx_ms = generations(args.target, args.per_category, args.max_tokens,
                                          measure_context=args.ctx_us is None)
    t = costs(t_forward)
    c = true_costs(t, ctx_ms if args.ctx_us is None else args.ctx_us / 1000)
    ks = args.k or [4, 8, 12]
    print("T(k)/T(1), k = 1..16:", " ".join(f"{x / t[1]:.2f}" for x in t[1:]))
    k = max(range(1, K_MAX + 1), key=lambda k: k / t[k])
    print(f"ceiling, every cycle {k - 1} right drafts: {k}·T(1)/T({k}) = {k * t[1] / t[k]:.2f}")
    ctx = statistics.median(len(g.prompt) + len(g.output) // 2 for g in gens)
    print(f"attention: {c.ctx_ms * 1000:.2f} µs per query token and cached token; at the median context of "
          f"{ctx:.0f} tokens T(1) = {c.t_verify(ctx)[1]:.1f} ms, T(16) = {c.t_verify(ctx)[16]:.1f} ms "
          f"({c.t_verify(ctx)[16] / c.t_verify(ctx)[1]:.2f}·T(1))\n")
    policies: dict[str, Policy | Scheduler] = {
        "auto": Scheduler(CostModel(t_forward, ctx_ms=c.ctx_ms, base_context=PROFILE_CONTEXT))}
    policies |= {f"k={k}": fixed(k) for k in ks} | {f"native-{k}": native(k) for k in ks}
    cats = sorted({g.category for g in gens})
    rows = {name: [replay(g, c, p)[0] for g in gens] for name, p in policies.items()}
    rows["oracle"] = [oracle(g, c) for g in gens]
    print("| policy | " + " | ".join(cats) + " | all |")
    print("|---" * (len(cats) + 2) + "|")
    for name, speedups in rows.items():
        med = [statistics.median(s for s, g in zip(speedups, gens) if g.category == c) for c in cats]
        print(f"| {name} | " + " | ".join(f"{m:.2f}" for m in med) + f" | {statistics.median(speedups):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
