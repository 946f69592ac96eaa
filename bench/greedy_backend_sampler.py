"""llama.cpp's greedy backend sampler against Backend.eval_argmax, fairly: context A keeps the sampler
attached for good (no graph re-plan between calls), context B reads the argmax in place
(eval_argmax). Same model, tokens and context, calls alternated, medians of 41.

    .venv/bin/python bench/greedy_backend_sampler.py ~/.cache/edgespec/models/gemma-3-270m-q4_k_m.gguf

Kept as the evidence for not using the sampler (bench/results/host/greedy-argmax-backend-sampler.md).
Two things it needs from llama.cpp: n_outputs_max_per_seq ≥ γ+1 (the default, 1, makes llama_decode
fail), and a fresh sampler chain per attach (re-attaching one aborts the process).
"""

from __future__ import annotations

import sys
import time

import numpy as np

from edgespec.backends.llama_cpp import LlamaCppBackend
from edgespec.bench.provenance import line, provenance

CONTEXT = "The history of the printing press begins with movable type. " * 6
DRAFT = " the quick brown fox jumps over the lazy dog and runs"


class Sampled(LlamaCppBackend):
    """A target whose context takes every output row through the backend sampler."""

    def _configure_context(self, cp) -> None:
        cp.n_outputs_max_per_seq = 64


def main(path: str, repeats: int = 45) -> None:
    print(f"ran at: {line(provenance())}", flush=True)
    a, b = Sampled(path, n_ctx=512, threads=2), LlamaCppBackend(path, n_ctx=512, threads=2)
    ll = a._ll
    chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
    ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_greedy())
    assert ll.llama_set_sampler(a._ctx, 0, chain)
    ctx = a.tokenize(CONTEXT)[:96]
    a.eval(ctx, rows="none")
    b.eval(ctx, rows="none")
    for g in (0, 8):
        toks = a.tokenize(DRAFT, add_special=False)[:g + 1]
        ta, tb = [], []
        for r in range(repeats):
            for who in (a, b) if r % 2 else (b, a):
                who.truncate(len(ctx))
                t = time.perf_counter()
                if who is a:
                    a._decode(toks, [True] * len(toks))
                    ids = [ll.llama_get_sampled_token_ith(a._ctx, i) for i in range(len(toks))]
                    ta.append(time.perf_counter() - t)
                else:
                    ref = b.eval_argmax(toks)
                    tb.append(time.perf_counter() - t)
            assert list(ids) == list(ref), (ids, ref)
        ma, mb = np.median(ta[4:]), np.median(tb[4:])
        print(f"{path.split('/')[-1]} γ={g}: backend sampler {1000 * ma:.3f} ms, in-place argmax {1000 * mb:.3f} ms, "
              f"sampler/in-place {ma / mb:.3f}")
    a.close()
    b.close()
    ll.llama_sampler_free(chain)


if __name__ == "__main__":
    main(sys.argv[1])
