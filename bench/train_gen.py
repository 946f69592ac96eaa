"""Throughput of head-training data: batched self-distillation against one sequence, and feature
extraction, on a llama.cpp target.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/train_gen.py --target smollm2 --prompts 16 --tokens 64 --threads 2

Generation: the same greedy replies to ``--prompts`` generated prompts (``train.prompt_gen``),
``--tokens`` reply tokens each, by a plain one-sequence backend (build_cache's loop) and by
``BatchGenerator`` with n_seq 1 and ``--n-seq``; tokens/s counts reply tokens, prompt time included.
Features: ``build_cache`` of the batched replies on ``LlamaFeatureBackend`` (one rows="all" eval,
features and top-k labels per sequence, files written); tokens/s counts every cached token.
Shards: reading the cache back as the trainer does (``trainer.sequence_tensors``: float32 feature rows as
torch tensors), tokens/s: what a training pass over cached features pays for its data, against the
extraction's rate, which features computed on the fly would pay on every pass.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from edgespec.backends.llama_cpp import LlamaCppBackend
from edgespec.backends.llama_features import LlamaFeatureBackend
from edgespec.bench.provenance import line, provenance
from edgespec.models import resolve_model
from edgespec.train.features import CachePlan, FeatureCache, build_cache, chat_tokens
from edgespec.train.generate import BatchGenerator, chat_prompts, self_distill
from edgespec.train.prompt_gen import generate_prompts


def single(path: Path, prompts: list[tuple[str, ...]], tokens: int, threads: int) -> tuple[list[list[int]], float]:
    with LlamaCppBackend(path, n_ctx=1024, threads=threads) as be:
        t0, out = time.perf_counter(), []
        for p in prompts:
            be.truncate(0)
            row, reply = be.eval(chat_tokens(be, p))[-1], []
            while len(reply) < tokens and not be.is_eog(nxt := int(np.argmax(row))):
                reply.append(nxt)
                row = be.eval([nxt])[-1]
            out.append(reply)
        return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-seq", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    print(f"ran at: {line(provenance())}", flush=True)
    path = resolve_model(a.target)
    generated = generate_prompts(a.prompts, seed=11)
    prompts = [p.turns for p in generated]
    rates: dict[str, list[float]] = {}
    for _ in range(a.repeats):  # alternating, so that a busy machine slows every variant alike
        ref, dt = single(path, prompts, a.tokens, a.threads)
        n = sum(map(len, ref))
        rates.setdefault("plain backend, 1 sequence", []).append(n / dt)
        for n_seq in (1, a.n_seq):
            with BatchGenerator(path, n_seq=n_seq, seq_ctx=512, threads=a.threads) as gen:
                t0 = time.perf_counter()
                seqs = self_distill(gen, *chat_prompts(gen, generated), max_new=a.tokens, greedy_share=1.0)
                dt = time.perf_counter() - t0
            same = sum(s.reply == r for s, r in zip(seqs, ref))
            rates.setdefault(f"BatchGenerator n_seq={n_seq} ({same}/{len(prompts)} replies equal to plain)",
                             []).append(n / dt)
    print(f"{len(prompts)} prompts x up to {a.tokens} greedy reply tokens ({n} in all), {a.threads} threads; "
          "reply tokens/s per repeat (median):")
    for name, r in rates.items():
        print(f"  {name}: {' '.join(f'{x:.1f}' for x in r)} ({np.median(r):.1f})")
    plan = CachePlan(target=str(path), target_size=path.stat().st_size, seq_len=512, corpus_chars=0)
    with tempfile.TemporaryDirectory() as d, LlamaFeatureBackend(path, n_ctx=1024, threads=a.threads) as be:
        t0 = time.perf_counter()
        cache = build_cache(be, Path(d), plan, [], generated=seqs)
        dt = time.perf_counter() - t0
        total = sum(m["tokens"] for m in cache.manifest())
        read = shard_read_rate(cache)
    print(f"features ({be.feature_method}, layers {list(be.feature_layers)}): {total} tokens in {dt:.1f} s "
          f"= {total / dt:.1f} tok/s")
    print(f"shards read back as training tensors: {read:.0f} tok/s ({read / (total / dt):.0f}x the extraction)")


def shard_read_rate(cache: FeatureCache, repeats: int = 3) -> float:
    """Tokens/s of reading every file of ``cache`` into the trainer's tensors (``trainer.sequence_tensors``,
    CPU; median of ``repeats``)."""
    from edgespec.train.trainer import sequence_tensors

    rates = []
    for _ in range(repeats):
        t0, n = time.perf_counter(), 0
        for f in cache.files():
            n += len(sequence_tensors(f)["tokens"])
        rates.append(n / (time.perf_counter() - t0))
    return float(np.median(rates))


if __name__ == "__main__":
    main()
