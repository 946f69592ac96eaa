"""`edgespec.load`: model files (or known model names) → a ready Engine."""

from __future__ import annotations

import os

from edgespec.backends.base import Backend
from edgespec.drafters.base import Drafter
from edgespec.engine import Engine
from edgespec.errors import EdgespecError

BACKENDS = ("llama.cpp", "mlx")


def open_backend(model: str | os.PathLike, backend: str = "llama.cpp", **options) -> Backend:
    """Open one model file (or known model name; on "mlx" also an mlx-lm directory) on a backend."""
    from edgespec.models import resolve_model

    if backend not in BACKENDS:
        raise EdgespecError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")
    if backend == "mlx":  # a GGUF file, an mlx-lm directory, or a known name
        from edgespec.backends.mlx import MlxBackend

        return MlxBackend(model, **options)
    from edgespec.backends.llama_cpp import LlamaCppBackend

    return LlamaCppBackend(resolve_model(str(model)), **options)


def load(
    target: str | os.PathLike | None = None,
    drafter: str | os.PathLike | None = "ngram",
    *,
    backend: str = "llama.cpp",
    n_ctx: int = 4096,
    threads: int | None = None,
    n_gpu_layers: int = 0,
    num_draft: int | str = "auto",
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
        verbose: show the backend's own log.

    Returns:
        An Engine (use it as a context manager, or call close()).
    """
    from edgespec.drafters.feature_heads import is_feature_head, open_head_target
    from edgespec.models import DEFAULT_TARGET

    options = dict(n_ctx=n_ctx, threads=threads, n_gpu_layers=n_gpu_layers, verbose=verbose)
    head = drafter is not None and is_feature_head(drafter)
    if backend not in BACKENDS:
        raise EdgespecError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")
    tgt = (open_head_target(target or DEFAULT_TARGET, drafter, backend, **options) if head  # type: ignore[arg-type]
           else open_backend(target or DEFAULT_TARGET, backend, **options))
    try:
        return Engine(tgt, make_drafter(drafter, tgt, backend, **options), num_draft=num_draft)
    except BaseException:
        tgt.close()
        raise


def make_drafter(spec: str | os.PathLike | None, target: Backend, backend: str = "llama.cpp",
                 **options) -> Drafter | None:
    """None / "none" → no drafter; "ngram" or "ngram:N_MAX[:N_MIN]" → prompt lookup; an EAGLE-3 head
    GGUF → EagleDrafter, a DFlash head GGUF → DFlashDrafter (DSparkDrafter with a Markov head; the
    target must capture their features: see `load`); else a draft model."""
    if spec is None or str(spec).lower() == "none":
        return None
    text = str(spec)
    if text == "ngram" or text.startswith("ngram:"):
        from edgespec.drafters.ngram import NgramDrafter

        parts = text.split(":")[1:]
        if len(parts) > 2 or not all(p.isdigit() for p in parts):
            raise EdgespecError(f"bad n-gram drafter {text!r}: use 'ngram', 'ngram:N_MAX' or 'ngram:N_MAX:N_MIN' "
                                f"with whole numbers (e.g. ngram:4:2)")
        try:
            return NgramDrafter(*(int(p) for p in parts))
        except ValueError as e:
            raise EdgespecError(f"bad n-gram drafter {text!r}: {e}") from None
    from edgespec.drafters.feature_heads import head_arch

    arch = head_arch(text)
    if arch == "eagle3":
        from edgespec.drafters.eagle import open_eagle3_drafter

        return open_eagle3_drafter(text, target, threads=options.get("threads"))
    if arch == "dflash":
        from edgespec.drafters.dflash import open_dflash_drafter

        return open_dflash_drafter(text, target, threads=options.get("threads"))
    from edgespec.drafters.draft_model import DraftModelDrafter, check_vocab_compatible

    model = open_backend(text, backend, **options)
    try:
        check_vocab_compatible(target, model)
    except BaseException:
        model.close()
        raise
    return DraftModelDrafter(model, target.n_vocab)
