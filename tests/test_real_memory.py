"""Peak memory of a 512-token speculative run (SmolLM2 + n-gram, greedy, n_ctx 1024).

Run in a fresh subprocess so that the models of this pytest process do not count. The subprocess
records its RSS at four points: after importing numpy/edgespec/llama.cpp (the baseline), after the
model load (just before the context is created), after `edgespec.load`, and its peak after the run.

Budget: model file + KV cache (from GGUF metadata; Q8_0 by default) + 15%, over the baseline, plus llama.cpp's
own CPU-side tables built at model load (vocabulary: token texts, scores, BPE merge maps; GGUF
metadata), measured in the subprocess as the anonymous memory the model load adds. For SmolLM2 those
tables are 17.3 MiB, 16% of file + KV: a fixed per-model cost that the 15% margin cannot also cover on
a 135M model (measured 2026-11-29 with the Q8_0 KV cache: peak - baseline 134.3 MiB vs
file + KV + 15% = 121.6 MiB). The decode
itself must stay within the 15%: no n_ctx × n_vocab logit buffers, no per-token growth.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_fixtures import read_gguf_kv

pytestmark = pytest.mark.real

MiB = 1024 * 1024
N_CTX = 1024
MAX_TOKENS = 512
MARGIN = 0.15
# Greedy SmolLM2 keeps counting far past 512 tokens; the n-gram drafter copies the ", " pattern.
PROMPT = "Count from 1 to 1000, separated by commas: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"

CHILD = r"""
import json, sys

def status():
    out = {}
    for line in open("/proc/self/status"):
        key, value = line.split(":", 1)
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out

import numpy
import edgespec
from edgespec.backends.deps import import_llama

ll = import_llama()
snap = {"baseline": status()}
init = ll.llama_init_from_model

def init_from_model(model, params):  # the model is loaded, its context not yet created
    snap.setdefault("model", status())
    return init(model, params)

ll.llama_init_from_model = init_from_model
path, n_ctx, max_tokens, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
engine = edgespec.load(path, drafter="ngram", n_ctx=n_ctx, threads=1, num_draft=4)
snap["loaded"] = status()
out = engine.generate(prompt, max_tokens=max_tokens)
snap["end"] = status()
s = out.stats
print(json.dumps({"snap": snap, "n_tokens": len(out.tokens), "finish_reason": out.finish_reason,
                  "n_drafted": s.n_drafted, "n_accepted": s.n_accepted, "tau": s.tau,
                  "stats_peak_rss_mb": s.peak_rss_mb, "n_past": engine.target.n_past,
                  "n_kv": len(engine._kv), "kv_type": engine.target.kv_type}))
"""


BYTES_PER_VALUE = {"f16": 2.0, "f32": 4.0, "q8_0": 34 / 32}  # Q8_0: 32 int8 values + an f16 scale


def kv_cache_bytes(path: Path, n_ctx: int, kv_type: str) -> int:
    """n_layer × n_ctx × 2 (K and V) × n_head_kv × head_dim × bytes per value, from GGUF metadata."""
    keys = {"llama.block_count", "llama.attention.head_count_kv", "llama.embedding_length",
            "llama.attention.head_count"}
    kv = read_gguf_kv(path, keys)
    head_dim = kv["llama.embedding_length"] // kv["llama.attention.head_count"]
    n_values = kv["llama.block_count"] * n_ctx * 2 * kv["llama.attention.head_count_kv"] * head_dim
    return int(n_values * BYTES_PER_VALUE[kv_type])


def test_peak_rss_of_a_512_token_speculative_run(smollm2_path):
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(smollm2_path), str(N_CTX), str(MAX_TOKENS), PROMPT],
        capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    snap = r["snap"]

    assert r["n_tokens"] == MAX_TOKENS and r["finish_reason"] == "length"
    assert r["n_drafted"] > 0 and r["n_accepted"] > 0
    assert r["n_past"] == r["n_kv"] <= N_CTX

    file_size = smollm2_path.stat().st_size
    kv_size = kv_cache_bytes(smollm2_path, N_CTX, r["kv_type"])
    assert r["kv_type"] == "q8_0"  # the default KV cache (batch-invariant, see backends/llama_cpp.py)
    assert kv_size == 30 * N_CTX * 2 * 3 * 64 * 34 // 32  # SmolLM2-135M: 30 layers, 3 KV heads of 64
    base = snap["baseline"]["VmRSS"]
    peak = snap["end"]["VmHWM"]
    tables = snap["model"]["RssAnon"] - snap["baseline"]["RssAnon"]  # llama.cpp's vocab/metadata
    brief_budget = (file_size + kv_size) * (1 + MARGIN)
    budget = brief_budget + tables
    growth = peak - snap["loaded"]["VmRSS"]  # what the 512-token run adds
    print(f"\npeak RSS {peak / MiB:.1f} MiB = baseline {base / MiB:.1f} (python+numpy+edgespec+libllama)"
          f" + model load {(snap['model']['VmRSS'] - base) / MiB:.1f}"
          f" (file pages {(snap['model']['RssFile'] - snap['baseline']['RssFile']) / MiB:.1f},"
          f" llama.cpp tables {tables / MiB:.1f})"
          f" + context {(snap['loaded']['VmRSS'] - snap['model']['VmRSS']) / MiB:.1f} (KV {kv_size / MiB:.1f})"
          f" + decode {growth / MiB:.1f}")
    print(f"peak - baseline {(peak - base) / MiB:.1f} MiB; file {file_size / MiB:.1f} + KV {kv_size / MiB:.1f}"
          f" + {MARGIN:.0%} = {brief_budget / MiB:.1f} MiB; + llama.cpp tables = budget {budget / MiB:.1f} MiB;"
          f" τ {r['tau']:.2f}")

    assert abs(r["stats_peak_rss_mb"] * MiB - peak) < 4 * MiB  # Stats.peak_rss_mb reports this peak
    assert growth <= MARGIN * (file_size + kv_size), f"the decode added {growth / MiB:.1f} MiB"
    assert tables < 0.2 * file_size  # a sanity bound on what is excused from the budget
    assert peak - base <= budget, f"peak - baseline {(peak - base) / MiB:.1f} MiB > budget {budget / MiB:.1f}"
