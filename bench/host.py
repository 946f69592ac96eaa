"""The host path of a speculative cycle, timed without a GPU: sampling, verification, the loop.

Rows are real where models are fetched (~/.cache/edgespec/models, through the llama.cpp backend:
SmolLM2's 49k vocabulary, Gemma-3's 262k) and LM-like synthetic rows for 128k and 152k (a normal
bulk under a peaked head: a nucleus of ~10 tokens at T 0.7, top-p 0.95). Per vocabulary, γ and
parameter set it times, one thread, medians of alternating repeats:

- `process` of the γ+1 rows, before (edgespec/sampling.py at d32baf2, read from git: one row at
  a time, float64 softmax) and after (edgespec.sampling.process_rows);
- `verify` with a one-hot q (n-gram) and with a full q (a draft model), every draft accepted
  (the most rows a cycle can process);
- a draft model's sampling of one token (`Chain.step`, as the neural drafters draw);
- llama.cpp's own sampler chain (top_k, top_p, min_p, temp, dist; greedy) on the same rows.

It also runs the engine loop on a zero-latency target (reference-style tables, rows computed in
a few µs) with the n-gram drafter: the loop's own µs per cycle and per token, scheduler included.

    .venv/bin/python bench/host.py --out bench/results/host/

Writes host.md (tables) and host.json. Needs a git checkout: "before" is edgespec/sampling.py and
verify.py as committed at a revision, d32baf2 (the row-at-a-time code, also tests/host_oracle.py)
unless `--against REV` names another. `--loop-only` times just the loop (run it from an older
checkout for its "before" numbers), and `--only` times the named vocabularies / parameter sets alone:

    .venv/bin/python bench/host.py --against HEAD --only "152k synthetic" --out /tmp/host-ab
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
import types
from functools import partial
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from edgespec.backends.reference import ReferenceBackend  # noqa: E402
from edgespec.bench.provenance import line as provenance_line  # noqa: E402
from edgespec.bench.provenance import provenance  # noqa: E402
from edgespec.drafters.ngram import NgramDrafter  # noqa: E402
from edgespec.engine import Engine  # noqa: E402
from edgespec.sampling import SamplingParams  # noqa: E402

ROW_AT_A_TIME = "d32baf2"  # the last revision that processed one row at a time (tests/host_oracle.py)

PARAMS = {
    "greedy": SamplingParams(),
    "T0.7": SamplingParams(0.7),
    "T0.7 top-p0.95": SamplingParams(0.7, top_p=0.95),
    "top-k40 top-p0.95": SamplingParams(0.7, top_k=40, top_p=0.95),
    "min-p0.05": SamplingParams(0.7, min_p=0.05),
}
GAMMAS = (0, 4, 8, 16)
MODELS = {"49k SmolLM2": "SmolLM2-135M-Instruct.Q4_1.gguf", "262k Gemma-3": "gemma-3-270m-q4_k_m.gguf"}
SYNTHETIC = {"128k synthetic": 128256, "152k synthetic": 152064}
PROMPT = ("The committee met on Tuesday to discuss the budget. After a long debate about the new library, "
          "the members agreed that the town should")


class AcceptAll:
    """An rng whose draws are 0: verification accepts every draft with p(x̃) > 0 (the longest cycle)."""

    def random(self) -> float:
        return 0.0


CLOCK = time.perf_counter  # --cpu: time.thread_time, a shared machine's preemption left out


def median_ms(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t0 = CLOCK()
        fn()
        ts.append(CLOCK() - t0)
    return 1000 * statistics.median(ts)


def paired_ms(before, after, repeats: int) -> tuple[float, float]:
    """Medians of `before` and `after`, run alternately (a noisy machine hits both alike)."""
    tb, ta = [], []
    for _ in range(repeats):
        for f, out in ((before, tb), (after, ta)):
            t0 = CLOCK()
            f()
            out.append(CLOCK() - t0)
    return 1000 * statistics.median(tb), 1000 * statistics.median(ta)


def recorded_rows(path: Path, n: int = 17) -> np.ndarray:
    """(n, V) float32 logits the model gives after the first tokens of PROMPT (llama.cpp backend)."""
    from edgespec.drafters.registry import open_backend

    with open_backend(str(path), n_ctx=256, threads=1) as b:
        ids = b.tokenize(PROMPT)[: n + 4]
        return np.ascontiguousarray(b.eval(ids, rows="all")[-n:], dtype=np.float32)


def synthetic_rows(n_vocab: int, n: int = 17, seed: int = 0) -> np.ndarray:
    """(n, V) float32 LM-like rows: a normal bulk (σ 2.5) under a head of a dozen tokens 3-8
    logits above the bulk's maximum. Like Gemma-3's recorded rows, 1-3% of the vocabulary then lies
    within 14 logits (20·T at T 0.7) of the top, and T 0.7, top-p 0.95 keeps a nucleus of ~10."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 2.5, (n, n_vocab)).astype(np.float32)
    for r in range(n):
        head = rng.choice(n_vocab, 12, replace=False)
        x[r, head] = x[r].max() + np.sort(rng.uniform(0.0, 5.0, 12))[::-1] + 3.0
    return x


class LlamaChain:
    """llama.cpp's sampler chain (its default order: top_k, top_p, min_p, temp, dist) applied to
    numpy rows through the low-level API, the token-data array refilled per row as llama.cpp does."""

    def __init__(self, params: SamplingParams, n_vocab: int) -> None:
        from edgespec.backends.deps import import_llama

        ll = self.ll = import_llama()
        self.chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        parts = [ll.llama_sampler_init_greedy()] if params.greedy else [
            *([ll.llama_sampler_init_top_k(params.top_k)] if params.top_k else []),
            *([ll.llama_sampler_init_top_p(params.top_p, 1)] if params.top_p < 1 else []),
            *([ll.llama_sampler_init_min_p(params.min_p, 1)] if params.min_p > 0 else []),
            ll.llama_sampler_init_temp(params.temperature), ll.llama_sampler_init_dist(1234)]
        for s in parts:
            ll.llama_sampler_chain_add(self.chain, s)
        self.data = np.zeros(n_vocab, dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
        self.ids = np.arange(n_vocab, dtype=np.int32)

    def sample(self, row: np.ndarray) -> int:
        d = self.data
        d["id"], d["logit"] = self.ids, row
        arr = self.ll.llama_token_data_array(d.ctypes.data_as(self.ll.llama_token_data_p), d.shape[0], -1, False)
        self.ll.llama_sampler_apply(self.chain, ctypes.byref(arr))
        return int(d["id"][arr.selected])

    def close(self) -> None:
        self.ll.llama_sampler_free(self.chain)


def host_rows(name: str, x: np.ndarray, repeats: int) -> list[dict]:
    """Every (parameter set, γ) row of the table for one vocabulary's logits x (17, V)."""
    out = []
    q_logits = x + np.random.default_rng(1).normal(0, 0.5, x.shape).astype(np.float32)  # a draft model's rows
    for label, params in PARAMS.items():
        chain = LlamaChain(params, x.shape[1])
        anchor = median_ms(partial(chain.sample, x[0]), repeats)
        chain.close()
        d_old, d_new = paired_ms(partial(old_draft_token, q_logits[0], params, np.random.default_rng(0)),
                                 partial(new_draft_token, q_logits[0], params, np.random.default_rng(0)), repeats)
        for gamma in GAMMAS:
            out.append(dict(vocab=name, params=label, gamma=gamma, llama_chain_per_row_ms=anchor,
                            draft_token_before_ms=d_old, draft_token_after_ms=d_new,
                            **cycle_times(x[: gamma + 1], q_logits[:gamma], params, repeats)))
    return out


def cycle_times(rows: np.ndarray, q_logits: np.ndarray, params: SamplingParams, repeats: int) -> dict:
    """process, verify (one-hot q, full q) of one cycle's γ+1 rows, before and after."""
    from edgespec.sampling import process
    from edgespec.verify import verify

    gamma = rows.shape[0] - 1
    q = np.stack([process(r, params) for r in q_logits]) if gamma else np.zeros((0, rows.shape[1]))
    one_hot = [int(np.argmax(r)) for r in rows[:gamma]]
    sampled = [int(np.argmax(r)) for r in q]
    p_old, p_new = paired_ms(partial(old_process_rows, rows, params), partial(new_process_rows, rows, params), repeats)
    if params.greedy and old.rev != ROW_AT_A_TIME:
        v_old, v_new = paired_ms(partial(old.verify.verify, rows, one_hot, None, params, AcceptAll()),
                                 partial(verify, rows, one_hot, None, params, AcceptAll()), repeats)
        f_old, f_new = v_old, v_new
    elif params.greedy:  # verify_greedy is unchanged since d32baf2: the argmax of each row
        v_old = v_new = f_old = f_new = median_ms(partial(verify, rows, one_hot, None, params, AcceptAll()), repeats)
    else:
        v_old, v_new = paired_ms(partial(old.verify_stochastic, rows, one_hot, None, params, AcceptAll()),
                                 partial(verify, rows, one_hot, None, params, AcceptAll()), repeats)
        f_old, f_new = paired_ms(partial(old.verify_stochastic, rows, sampled, q, params, AcceptAll()),
                                 partial(verify, rows, sampled, q, params, AcceptAll()), repeats)
    return dict(process_before_ms=p_old, process_after_ms=p_new, verify_onehot_before_ms=v_old,
                verify_onehot_after_ms=v_new, verify_fullq_before_ms=f_old, verify_fullq_after_ms=f_new,
                after_per_row_ms=p_new / (gamma + 1))


def old_process_rows(rows: np.ndarray, params: SamplingParams) -> list:
    batched = getattr(old.sampling, "process_rows", None)
    if batched is not None:  # the revision's own process_rows, as "after" is timed
        return list(batched(rows, params))
    return [old.process(r, params) for r in rows]


class Revision:
    """edgespec/sampling.py and verify.py as committed at a git revision: the "before" column
    (their `process`, `verify_stochastic`, `sample`)."""

    def __init__(self, rev: str) -> None:
        self.rev = rev

        def module(path: str, name: str, source: str) -> types.ModuleType:
            mod = sys.modules[name] = types.ModuleType(name)
            exec(compile(source, f"{rev}:{path}", "exec"), mod.__dict__)
            return mod

        def show(path: str) -> str:
            return subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{path}"], check=True,
                                  capture_output=True, text=True).stdout

        self.sampling = module("edgespec/sampling.py", "rev_sampling", show("edgespec/sampling.py"))
        self.verify = module("edgespec/verify.py", "rev_verify", show("edgespec/verify.py").replace(
            "from edgespec.sampling import", "from rev_sampling import"))
        self.sample = self.sampling.sample

    def process(self, row: np.ndarray, params: SamplingParams) -> np.ndarray:
        return self.sampling.process(row, params)

    def verify_stochastic(self, *args) -> tuple[int, int]:
        return self.verify.verify(*args)


old: Revision  # the "before" column, set in main()


def new_process_rows(rows: np.ndarray, params: SamplingParams) -> list:
    from edgespec.sampling import process_rows

    return list(process_rows(rows, params))


def old_draft_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One drafted token as Chain.step drew it before: process, confidence, sample."""
    from edgespec.drafters.base import confidence

    q = None if params.greedy else old.process(logits, params)
    confidence(logits, q)
    return int(np.argmax(logits)) if q is None else old.sample(q, rng)


def new_draft_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int | None:
    from edgespec.drafters.base import Chain

    return Chain(params, rng, None).step(logits)


class ZeroLatency(ReferenceBackend):
    """The reference model's tables with every row computed in one vectorised step: a target whose
    forward costs microseconds. With `step_ms`, each forward also waits (spinning) like a memory-bound
    GPU step (T(k) = step·(1 + 0.01·(k − 1))), so the scheduler calibrates to that regime; `busy_s`
    counts the CPU time spent inside eval, and the loop's own CPU time is what remains."""

    def __init__(self, *args, step_ms: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.step_s, self.busy_s = step_ms / 1000, 0.0

    def eval(self, tokens, rows="last"):
        t0, c0 = time.perf_counter(), time.thread_time()
        start = len(self._tokens)
        self._tokens.extend(int(t) for t in tokens)
        self.n_evals += 1
        n = len(self._tokens)
        lo = {"none": n, "last": n - 1, "all": start}[rows]
        prev = self._tokens[lo - 1: n - 1] if lo > 0 else [self.n_vocab, *self._tokens[: n - 1]]
        out = (self.w1[self._tokens[lo:]] + self.w2[prev]).astype(np.float32)
        end = t0 + self.step_s * (1 + 0.01 * (len(tokens) - 1))
        while time.perf_counter() < end:  # a spin, as a GPU stream's sync waits (a sleep would cool the caches)
            pass
        self.busy_s += time.thread_time() - c0
        return out


def loop_rows(repeats: int, short: int = 300, step_ms: float = 7.0) -> list[dict]:
    """The loop's own µs per cycle and per token (the thread's CPU time minus the target's forwards:
    a shared machine's preemption left out) of whole
    generations with the n-gram drafter, on a target whose steps take `step_ms` (a memory-bound
    GPU's), and on one taking microseconds (also over a 4000-token generation: what grows with
    the context)."""
    out = []
    for step, n_tokens in ((step_ms, short), (0.0, short), (0.0, 4000)):  # the last: a long context
        for label, params in (("greedy", SamplingParams()), ("T0.7", SamplingParams(0.7))):
            for k in (8, "auto"):
                target = ZeroLatency(12, seed=3, scale=4.0, n_ctx=8192, step_ms=step)
                engine = Engine(target, NgramDrafter(), num_draft=k)
                engine.generate("abcab", max_tokens=8)  # calibration and the scheduler's set-up happen here
                own, cycles, toks = [], 0, 0
                for i in range(repeats):
                    engine.reset()
                    target.busy_s = 0.0
                    t0 = time.thread_time()
                    g = engine.generate("abcab", max_tokens=n_tokens, temperature=params.temperature, seed=i)
                    own.append(time.thread_time() - t0 - target.busy_s)
                    cycles, toks = g.stats.n_cycles, len(g.tokens)
                t = statistics.median(own)
                out.append(dict(step_ms=step, params=label, num_draft=str(k), tokens=toks, cycles=cycles,
                                us_per_cycle=1e6 * t / cycles, us_per_token=1e6 * t / toks))
    return out


def write(out: Path, host: list[dict], loop: list[dict], meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "host.json").write_text(json.dumps(dict(meta=meta, host=host, loop=loop), separators=(",", ":")) + "\n")
    lines = [f"# Host path ({meta['date']}, {meta['cpu']}, one thread)", "",
             f"Ran at: {provenance_line(meta)}", "",
             f"`{meta['command']}` (load {meta['load']:.1f}). ms per call ({meta['clock']}), medians of {meta['repeats']}, before and "
             f"after alternating; before = {meta['before']}, after = edgespec now; verify: every draft accepted; "
             "llama.cpp: its sampler chain on one row.", ""]
    if host:
        lines += ["| vocabulary | parameters | γ | process before | after | verify one-hot before | after | "
                  "verify full q before | after | per row after | llama.cpp per row | draft token before | after |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in host:
            lines.append(f"| {r['vocab']} | {r['params']} | {r['gamma']} | {r['process_before_ms']:.3f} | "
                         f"{r['process_after_ms']:.3f} | {r['verify_onehot_before_ms']:.3f} | "
                         f"{r['verify_onehot_after_ms']:.3f} | {r['verify_fullq_before_ms']:.3f} | "
                         f"{r['verify_fullq_after_ms']:.3f} | {r['after_per_row_ms']:.3f} | "
                         f"{r['llama_chain_per_row_ms']:.3f} | {r['draft_token_before_ms']:.3f} | "
                         f"{r['draft_token_after_ms']:.3f} |")
    if loop:
        lines += ["", "The engine loop's own time (CPU time minus the target's forwards), n-gram drafter, "
                  "scheduler included for auto; target step 7 ms (modeled GPU) or ~µs:", "",
                  "| target step | parameters | num_draft | tokens | cycles | loop µs per cycle | per token |",
                  "|---|---|---|---|---|---|---|"]
    for r in loop:
        lines.append(f"| {r['step_ms']:g} ms | {r['params']} | {r['num_draft']} | {r['tokens']} | {r['cycles']} | "
                     f"{r['us_per_cycle']:.0f} | {r['us_per_token']:.0f} |")
    lines += efficiency_lines(host, loop)
    (out / "host.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def efficiency_lines(host: list[dict], loop: list[dict], step_ms: float = 7.0, gamma: int = 8) -> list[str]:
    """The share of a cycle the target's step keeps, step / (step + host verify + the loop's own
    time), at γ = 8 (one-hot q: the n-gram drafter), before and after."""
    own = {r["params"]: r["us_per_cycle"] / 1000 for r in loop if r["step_ms"] == step_ms and r["num_draft"] == "8"}
    if not host or not own:
        return []
    lines = ["", f"Predicted efficiency for a {step_ms:g} ms target step, γ = {gamma} (one-hot q): "
             "step / (step + verify + the loop's own time):", "",
             "| vocabulary | parameters | host ms per cycle before | after | efficiency before | after |",
             "|---|---|---|---|---|---|"]
    for r in host:
        if r["gamma"] != gamma:
            continue
        loop_ms = own["greedy" if r["params"] == "greedy" else "T0.7"]
        b, a = r["verify_onehot_before_ms"] + loop_ms, r["verify_onehot_after_ms"] + loop_ms
        lines.append(f"| {r['vocab']} | {r['params']} | {b:.2f} | {a:.2f} | {step_ms / (step_ms + b):.2f} | "
                     f"{step_ms / (step_ms + a):.2f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/host")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--models", type=Path, default=Path(os.environ.get("EDGESPEC_HOME", Path.home() / ".cache/edgespec"))
                    / "models")
    ap.add_argument("--loop-only", action="store_true", help="time only the engine loop")
    ap.add_argument("--against", metavar="REV", help="'before' = sampling.py and verify.py at this git revision")
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="only these vocabularies or parameter sets (repeatable); skips the loop")
    ap.add_argument("--cpu", action="store_true", help="time by the thread's CPU clock (for a shared machine)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    global old, CLOCK
    if args.cpu:
        CLOCK = time.thread_time
    old = Revision(args.against or ROW_AT_A_TIME)
    if args.only:
        for label in [k for k in PARAMS if k not in args.only and any(o in PARAMS for o in args.only)]:
            del PARAMS[label]
    host: list[dict] = []
    if not args.loop_only:
        names = [n for n in (*MODELS, *SYNTHETIC) if not args.only or n in args.only or
                 not any(o in (*MODELS, *SYNTHETIC) for o in args.only)]
        sets = {n: recorded_rows(args.models / f) for n, f in MODELS.items() if n in names and (args.models / f).exists()}
        sets.update({n: synthetic_rows(v) for n, v in SYNTHETIC.items() if n in names})
        for name, x in sorted(sets.items(), key=lambda kv: kv[1].shape[1]):
            print(f"timing {name} ({x.shape[1]} ids)", file=sys.stderr)
            host += host_rows(name, x, args.repeats)
    loop = [] if args.only else loop_rows(max(3, args.repeats // 3))
    write(args.out, host, loop, dict(**provenance(REPO), repeats=args.repeats,
                                     load=os.getloadavg()[0], before=args.against or f"{ROW_AT_A_TIME} (row at a time)",
                                     clock="thread CPU time" if args.cpu else "wall clock",
                                     command=" ".join(sys.argv)))


if __name__ == "__main__":
    main()
