"""The one door to drafters: a drafter spec becomes a Drafter here, with the target it needs.

A spec is None or "none" (plain decoding), "ngram[:N_MAX[:N_MIN]]" (prompt lookup), "history[:MAX_TOKENS]
[@CORPUS_FILE]" (lookup in the context, earlier ones and a corpus), a GGUF path or known model name with the
target's vocabulary (a draft model), or a feature-head GGUF: EAGLE-3 ("eagle3") or DFlash ("dflash"; DSpark
with the Markov head, markov_w1.weight), or a published EAGLE-3 / DFlash checkpoint directory, converted
once against the target and cached (drafters.heads). A head drafts from the target's hidden states, so
its target is opened to capture the layers the head reads: `open_target` decides that.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from edgespec.backends.base import Backend
from edgespec.drafters.base import Drafter
from edgespec.drafters.heads import HeadImpl, check_target_header, converted, open_head, read_head
from edgespec.errors import EdgespecError

BACKENDS = ("llama.cpp", "mlx")
Spec = str | os.PathLike[str]

# -- targets ------------------------------------------------------------------------------------------


def open_backend(model: Spec, backend: str = "llama.cpp", **options: Any) -> Backend:
    """Open one model file (or known model name; on "mlx" also an mlx-lm directory) on a backend.

    Args:
        model: the GGUF path, known model name or (on "mlx") mlx-lm directory.
        backend: "llama.cpp" or "mlx".
        **options: as for LlamaCppBackend / MlxBackend (n_ctx, threads, n_gpu_layers, verbose).
    """
    from edgespec.models import resolve_model

    _check_backend(backend)
    path = resolve_model(str(model))  # the one place a model name becomes a path
    if backend == "mlx":  # a GGUF file (converted once) or an mlx-lm directory
        from edgespec.backends.mlx import MlxBackend

        return MlxBackend(path, **options)
    from edgespec.backends.llama_cpp import LlamaCppBackend

    return LlamaCppBackend(path, **options)


def open_target(target: Spec | None, drafter: Spec | Sequence[Spec] | None = None, backend: str = "llama.cpp",
                **options: Any) -> Backend:
    """The target `drafter` drafts for: when it is a feature head, a target that captures the layers
    the head reads (LlamaFeatureBackend, or MlxFeatureBackend on "mlx"), after checking the
    target's header (hidden size, layer ids in 1..n_layer−1); else a plain backend.

    Args:
        target: GGUF path or known model name (on "mlx" also an mlx-lm directory); None: the default.
        drafter: a drafter spec, or several (bench): the first head among them decides the features.
        backend: "llama.cpp" or "mlx".
        **options: as for LlamaCppBackend / MlxBackend (n_ctx, threads, n_gpu_layers, verbose).
    """
    from edgespec.models import DEFAULT_TARGET, resolve_model

    _check_backend(backend)
    specs = [] if drafter is None else [drafter] if isinstance(drafter, (str, os.PathLike)) else list(drafter)
    specs = [converted(s, target) for s in specs]
    head = next((h for h in map(read_head, specs) if h is not None), None)
    if head is None:
        return open_backend(target or DEFAULT_TARGET, backend, **options)
    path = resolve_model(str(target or DEFAULT_TARGET))
    check_target_header(head, path)
    if backend == "mlx":
        from edgespec.backends.mlx_features import MlxFeatureBackend

        return MlxFeatureBackend(path, layers=head.layers, **options)
    from edgespec.backends.llama_features import LlamaFeatureBackend

    return LlamaFeatureBackend(path, layers=head.layers, **options)


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise EdgespecError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")

# -- drafters -----------------------------------------------------------------------------------------


def open_drafter(spec: Spec | None, target: Backend, backend: str = "llama.cpp", *, impl: HeadImpl = "auto",
                 **options: Any) -> Drafter | None:
    """The drafter for `spec` on `target` (a head's target opened by `open_target`).

    Args:
        spec: None / "none" → no drafter; "ngram" or "ngram:N_MAX[:N_MIN]" → NgramDrafter;
            "history[:MAX_TOKENS][@CORPUS_FILE]" → HistoryDrafter (docs/history.md); an EAGLE-3
            head GGUF → EagleDrafter; a DFlash head GGUF → DFlashDrafter (DSparkDrafter with a
            Markov head); a published head checkpoint directory → its converted GGUF's drafter;
            else a same-vocabulary draft model (DraftModelDrafter) on `backend`.
        target: the opened target.
        backend: the draft model's backend.
        impl: where a head runs: "llama" on libllama, "mlx" on MLX, "numpy" on the numpy reference
            (all tested equal); "auto" takes libllama for a llama.cpp target and MLX for an MLX
            target. Measured on SmolLM2 (1 thread, T(1) 11 ms) with a random F16 EAGLE-3 head, a
            chain step costs 0.9 ms on libllama against 56 ms in numpy at V_d 8192 (numpy's
            float64 matmuls convert the weights on every call); on MLX 6.2 ms against 61 ms. A
            DSpark head's Markov head runs in numpy on every impl.
        **options: as for LlamaCppBackend / MlxBackend; a libllama head takes `threads`.

    Raises:
        EdgespecError (VocabMismatchError) naming both files unless the drafter can draft for `target`.
    """
    if spec is None or str(spec).lower() == "none":
        return None
    text = str(spec)
    if text == "ngram" or text.startswith("ngram:"):
        return _ngram(text)
    if text == "history" or text.startswith(("history:", "history@")):
        return _history(text, target)
    spec = converted(spec, target.path)
    head = read_head(spec)
    if head is not None:
        return open_head(head, target, impl, options.get("threads"))
    from edgespec.drafters.draft_model import DraftModelDrafter, check_vocab_compatible

    model = open_backend(spec, backend, **options)
    try:
        check_vocab_compatible(target, model)
    except BaseException:
        model.close()
        raise
    return DraftModelDrafter(model, target.n_vocab)


def _ngram(text: str) -> Drafter:
    from edgespec.drafters.ngram import NgramDrafter

    parts = text.split(":")[1:]
    if len(parts) > 2 or not all(p.isdigit() for p in parts):
        raise EdgespecError(f"bad n-gram drafter {text!r}: use 'ngram', 'ngram:N_MAX' or 'ngram:N_MAX:N_MIN' "
                            f"with whole numbers (e.g. ngram:4:2)")
    try:
        return NgramDrafter(*(int(p) for p in parts))
    except ValueError as e:
        raise EdgespecError(f"bad n-gram drafter {text!r}: {e}") from None


def _history(text: str, target: Backend) -> Drafter:
    """A "history[:MAX_TOKENS][@CORPUS_FILE]" spec's HistoryDrafter, its corpus tokenized by the target."""
    from edgespec.drafters.history import HistoryDrafter

    (head, at, corpus), docs = text.partition("@"), []
    parts = head.split(":")[1:]
    if len(parts) > 1 or not all(p.isdigit() for p in parts) or (at and not corpus):
        raise EdgespecError(f"bad history drafter {text!r}: use 'history[:MAX_TOKENS][@CORPUS_FILE]' (e.g. history@notes.txt)")
    if corpus:
        path = Path(corpus).expanduser()
        if not path.is_file():
            raise EdgespecError(f"history corpus file {corpus} not found")
        try:
            docs = [target.tokenize(path.read_text(encoding="utf-8"), add_special=False)]
        except (OSError, UnicodeDecodeError) as e:
            raise EdgespecError(f"cannot read history corpus file {corpus}: {e}") from None
    try:
        return HistoryDrafter(*(int(p) for p in parts), corpus_tokens=docs)
    except ValueError as e:
        raise EdgespecError(f"bad history drafter {text!r}: {e}") from None

