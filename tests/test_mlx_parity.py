"""The MLX backend against llama.cpp on the real models: same token sequences, logits compared row
by row, and greedy speculative == plain on MLX with the n-gram drafter.

Tolerance (stated in the README): top-1 agreement >= 99% over >= 500 positions, and per position
max|Δlogit| <= REL_TOL × (llama.cpp's logit range at that position). Exact equality is not
expected: llama.cpp quantizes activations to 8 bits for its quantized dot products, MLX does not.
"""

from __future__ import annotations

import numpy as np
import pytest
from real_prompts import PROMPTS

pytest.importorskip("mlx.core", reason="mlx is not installed: pip install 'edgespec[mlx]'")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed: pip install 'edgespec[mlx]'")

import edgespec  # noqa: E402
from edgespec.api import open_backend  # noqa: E402
from edgespec.cli.app import DEMO_PROMPT  # noqa: E402

pytestmark = pytest.mark.real
N_POSITIONS = 512
REL_TOL = {"smollm2": 0.08, "gemma3": 0.08}  # measured worst cases in the README, with margin


def parity(path, n_positions: int = N_POSITIONS, chunk: int = 64) -> tuple[float, np.ndarray, int]:
    """(top-1 agreement, per-position max|Δ| / logit range, positions) over one long token sequence,
    evaluated in chunks of `chunk` rows on both backends."""
    lc = open_backend(path, n_ctx=1024, kv_type="f32")  # the reference: no 8-bit KV cache on its side
    ml = open_backend(path, "mlx", n_ctx=1024)
    text = "\n\n".join([*PROMPTS, DEMO_PROMPT, *PROMPTS[::-1]])
    ids = lc.tokenize(text)[:n_positions]
    assert ml.tokenize(text)[:n_positions] == ids
    agree, rel = 0, []
    for s in range(0, len(ids), chunk):
        a, b = lc.eval(ids[s:s + chunk], "all"), ml.eval(ids[s:s + chunk], "all")  # (rows, V)
        agree += int((a.argmax(1) == b.argmax(1)).sum())
        rel.extend(np.abs(a - b).max(1) / (a.max(1) - a.min(1)))
    lc.close()
    ml.close()
    return agree / len(ids), np.array(rel), len(ids)


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
@pytest.mark.slow
def test_logits_match_llama_cpp(name, smollm2_path, gemma_q4_path):
    path = {"smollm2": smollm2_path, "gemma3": gemma_q4_path}[name]
    top1, rel, n = parity(path)
    print(f"{name}: {n} positions, top-1 agreement {top1:.2%}, max|Δ|/range: median {np.median(rel):.4f}, "
          f"p99 {np.quantile(rel, 0.99):.4f}, max {rel.max():.4f}")
    assert n >= 500
    assert top1 >= 0.99
    assert rel.max() <= REL_TOL[name]


@pytest.mark.slow
def test_smollm2_ngram_greedy_equals_plain_on_mlx(smollm2_path):
    with edgespec.load(smollm2_path, drafter="ngram", backend="mlx", n_ctx=1024) as engine:
        accepted = 0
        for prompt in PROMPTS[:5]:
            plain = engine.generate(prompt, max_tokens=64, speculative=False)
            spec = engine.generate(prompt, max_tokens=64, num_draft=4)
            assert spec.tokens == plain.tokens, prompt
            accepted += spec.stats.n_accepted
        assert accepted > 0
