"""`edgespec.load`: model files (or known model names) → a ready Engine."""

from __future__ import annotations

import os

from edgespec import session
from edgespec.engine import Engine


def load(
    target: str | os.PathLike | None = None,
    drafter: str | os.PathLike | None = "ngram",
    *,
    backend: str = "llama.cpp",
    n_ctx: int = 4096,
    threads: int | None = None,
    n_gpu_layers: int = 0,
    num_draft: int | str = "auto",
    tree: int | str = "off",
    verbose: bool = False,
) -> Engine:
    """Load a target model and a drafter.

    Args:
        target: GGUF path or known model name (see `edgespec models list`), or an mlx-lm model directory
            with backend="mlx"; default SmolLM2-135M-Instruct.
        drafter: None (plain decoding), "ngram" (prompt lookup), a same-vocabulary GGUF path/name, or
            an EAGLE-3 or DFlash head GGUF (general.architecture "eagle3" / "dflash"): the target is
            then opened to capture the hidden states the head reads, and the head runs on the same
            backend (on MLX: heads.eagle3_mlx / heads.dflash_mlx). A dflash GGUF with
            DSpark's Markov head (markov_w1.weight) drafts with DSparkDrafter.
        backend: "llama.cpp" or "mlx" (GGUF files are converted to MLX once and cached; the draft
            model runs on the same backend).
        n_ctx: context size in tokens (target and draft model).
        threads: CPU threads (default: up to 8).
        n_gpu_layers: layers offloaded on CUDA/Metal builds of llama.cpp (-1 = all).
        num_draft: γ, draft tokens per cycle, or "auto" (default): the scheduler picks γ per cycle,
            0 (a plain step) when speculation would lose.
        tree: "off" (default); "auto": under num_draft "auto", each cycle verifies a draft tree
            instead of the chain when it is priced faster (greedy decoding, or deterministic drafts);
            or N: every cycle verifies a draft tree of up to N nodes and depth γ in one forward (needs
            a fixed num_draft). Drafters that draft trees: draft models, n-gram, Medusa, EAGLE-3,
            DFlash, DSpark heads; others draft chains. Lossless as chains are.
        verbose: show the backend's own log.

    Returns:
        An Engine (use it as a context manager, or call close()). With num_draft "auto" its first
        speculative generation prices the pair (cached per model; `Engine.calibrate` chooses when).
    """
    return session.load(target, drafter, backend=backend, num_draft=num_draft, tree=tree, n_ctx=n_ctx, threads=threads,
                        n_gpu_layers=n_gpu_layers, verbose=verbose)
