"""Drafter specs and the tables that open models and drafters (edgespec.session assembles with them).

A spec is None or "none" (plain decoding), "ngram[:N_MAX[:N_MIN]]" (prompt lookup), "history[:MAX_TOKENS]
[@CORPUS_FILE]" (lookup in the context, earlier ones and a corpus), a GGUF path or known model name with the
target's vocabulary (a draft model), or a feature-head GGUF: EAGLE-3 ("eagle3") or DFlash ("dflash"; DSpark
with the Markov head, markov_w1.weight), or a published EAGLE-3 / DFlash checkpoint directory, converted
once against the target and cached (drafters.heads), "mtp": the target's own MTP layers (drafters.mtp;
its target is opened with `mtp=True`), or a Medusa head GGUF ("medusa": drafters.medusa, on llama.cpp and
MLX; its target is opened with `hidden=True`, keeping its final-norm hidden states).

`plan_drafter` reads a spec once, with file work only (names resolved, a checkpoint converted, a head's
header read and checked against the target's), into a frozen DrafterPlan; `open_drafter` opens a plan
through one table of kinds, and `open_backend` a resolved model file through one table of runtimes. A head
drafts from the target's hidden states: its target is opened with `layers`, the ids the head reads.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgespec.backends.base import Backend
from edgespec.drafters.base import Drafter
from edgespec.drafters.heads import HeadFile, HeadImpl, check_target_header, converted, open_head, read_head
from edgespec.errors import EdgespecError

BACKENDS = ("llama.cpp", "mlx")
Spec = str | os.PathLike[str]


@dataclass(frozen=True)
class DrafterPlan:
    """A drafter spec, read once: what `open_drafter` opens."""

    spec: str  # as the user named it (messages and bench configs quote it)
    kind: str  # "ngram", "history", "model", "head", "mtp", "assistant", "medusa" or "chain"
    path: Path | None = None  # a draft model's file (or MLX directory); a head's GGUF
    numbers: tuple[int, ...] = ()  # ngram: N_MAX[, N_MIN]; history: MAX_TOKENS
    corpus: Path | None = None  # history's corpus file
    head: HeadFile | None = None  # a head's header (its target layers, hidden size, vocabulary)
    members: tuple[DrafterPlan, ...] = ()  # a chain's drafters, in order

    @property
    def parts(self) -> tuple[DrafterPlan, ...]:
        """A chain's member plans, or this plan alone."""
        return self.members or (self,)


def plan_model(path: Path, backend: str) -> Path:
    """A resolved model file made ready for `backend`: on "mlx" a GGUF file is converted (once, cached),
    so that opening it is a cache lookup. Returns `path`."""
    check_backend(backend)
    if backend == "mlx":
        import sys

        from edgespec.backends.mlx import mlx_model_dir

        mlx_model_dir(path, note=lambda line: print(line, file=sys.stderr))
    return path


def plan_drafter(spec: Spec | None, target: Path | None, backend: str = "llama.cpp") -> DrafterPlan | None:
    """Read `spec` for the target file `target` (resolved; None: the default): None for no drafter;
    one-line errors for a malformed spec, a missing corpus, or a head made for another target."""
    if spec is None or str(spec).lower() == "none":
        return None
    text = str(spec)
    if "," in text and not Path(text).expanduser().exists():
        return _plan_chain(text, target, backend)
    if text == "mtp":  # the target's own nextn layers (drafters.mtp): checked in the target's header
        if target is not None and backend == "llama.cpp":
            from edgespec.backends.llama_mtp import check_mtp_target

            check_mtp_target(target)
        elif target is not None and backend == "mlx":
            from edgespec.drafters.mtp_mlx import check_mlx_mtp_target

            check_mlx_mtp_target(target)
        return DrafterPlan(text, "mtp")
    if text == "ngram" or text.startswith("ngram:"):
        usage = "use 'ngram', 'ngram:N_MAX' or 'ngram:N_MAX:N_MIN' with whole numbers (e.g. ngram:4:2)"
        return DrafterPlan(text, "ngram", numbers=_numbers(text, "n-gram", 2, usage))
    if text == "history" or text.startswith(("history:", "history@")):
        head, at, corpus = text.partition("@")
        usage = "use 'history[:MAX_TOKENS][@CORPUS_FILE]' (e.g. history@notes.txt)"
        if at and not corpus:
            raise EdgespecError(f"bad history drafter {text!r}: {usage}")
        numbers = _numbers(head, "history", 1, usage)
        path = Path(corpus).expanduser() if corpus else None
        if path is not None and not path.is_file():
            raise EdgespecError(f"history corpus file {corpus} not found")
        return DrafterPlan(text, "history", numbers=numbers, corpus=path)
    from edgespec.backends.llama_mtp import check_assistant

    if check_assistant(spec, target):  # a Gemma-4 assistant: drafts from the target's KV cache (drafters.assistant)
        if backend != "llama.cpp":
            raise EdgespecError(f"the Gemma-4 assistant {text} drafts on llama.cpp only (not --backend {backend})")
        return DrafterPlan(text, "assistant", Path(spec).expanduser())
    spec = converted(spec, target)
    from edgespec.drafters.heads import head_arch

    if head_arch(spec) == "medusa":  # Medusa heads: read the target's final-norm hidden state (drafters.medusa)
        return _plan_medusa(text, Path(spec).expanduser(), target, backend)
    head = read_head(spec)
    if head is not None:
        if target is not None:
            check_target_header(head, target)
        return DrafterPlan(text, "head", Path(head.path).expanduser(), head=head)
    from edgespec.models import resolve_model

    return DrafterPlan(text, "model", plan_model(resolve_model(str(spec)), backend))


def _plan_medusa(text: str, path: Path, target: Path | None, backend: str) -> DrafterPlan:
    """Medusa heads checked against a GGUF target's header (an MLX directory's sizes are checked when the
    drafter opens)."""
    from edgespec.drafters.medusa import check_medusa_target_header, read_medusa_header

    if target is not None:
        check_medusa_target_header(path, target)  # hidden size and vocabulary, from both headers
    else:
        read_medusa_header(path)
    return DrafterPlan(text, "medusa", path)


def _plan_chain(text: str, target: Path | None, backend: str) -> DrafterPlan:
    """A chain "A,B[,...]": each member planned as a spec of its own (drafters.chain)."""
    parts = [p.strip() for p in text.split(",")]
    if any(not p or p.lower() == "none" for p in parts):
        raise EdgespecError(f"bad drafter chain {text!r}: name two or more drafters separated by commas "
                            f"(e.g. ngram,{'SmolLM2-135M-Instruct.Q4_1.gguf'})")
    members = tuple(plan_drafter(p, target, backend) for p in parts)
    return DrafterPlan(text, "chain", members=members)  # type: ignore[arg-type]  # none is None


def _numbers(text: str, name: str, most: int, usage: str) -> tuple[int, ...]:
    parts = text.split(":")[1:]
    if len(parts) > most or not all(p.isdigit() for p in parts):
        raise EdgespecError(f"bad {name} drafter {text!r}: {usage}")
    return tuple(int(p) for p in parts)


# -- open: models ----------------------------------------------------------------------------------


def open_backend(path: Path, backend: str = "llama.cpp", layers: Sequence[int] | None = None,
                 mtp: bool = False, hidden: bool = False, **options: Any) -> Backend:
    """Open a resolved model file (on "mlx" also an mlx-lm directory) on `backend`; with `layers`, a
    target that also captures the hidden states at those layer ids (for a feature head).

    Args:
        path: the GGUF file or MLX directory (edgespec.models.resolve_model has made names paths).
        backend: "llama.cpp" or "mlx".
        layers: target layer ids whose inputs a feature head reads (None: a plain backend).
        mtp: a target loaded with its MTP layers that keeps their input rows (drafters.mtp).
        hidden: a target that keeps its final-norm hidden states (Medusa heads: backends.llama_hidden,
            backends.mlx_hidden).
        **options: as for LlamaCppBackend / MlxBackend (n_ctx, threads, n_gpu_layers, verbose).
    """
    check_backend(backend)
    if mtp and backend == "mlx" and layers is None:
        mtp = False  # drafters.mtp_mlx taps a plain MlxBackend
    if mtp:
        if layers is not None or backend != "llama.cpp":
            raise EdgespecError(f"--drafter mtp runs on llama.cpp without a feature head (backend {backend!r}, "
                                f"head layers {layers})")
        from edgespec.backends.llama_mtp import LlamaMtpTarget

        return LlamaMtpTarget(path, **options)
    if hidden:
        if layers is not None or mtp:
            raise EdgespecError(f"Medusa heads draft without a feature head or MTP layers on the same target "
                                f"(backend {backend!r}, head layers {layers}, mtp {mtp})")
        return _HIDDEN[backend]()(path, **options)
    if layers is not None:
        options["layers"] = tuple(layers)
    return _BACKENDS[backend, layers is not None]()(path, **options)


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise EdgespecError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")


def _llama() -> type:
    from edgespec.backends.llama_cpp import LlamaCppBackend

    return LlamaCppBackend


def _llama_features() -> type:
    from edgespec.backends.llama_features import LlamaFeatureBackend

    return LlamaFeatureBackend


def _mlx() -> type:
    from edgespec.backends.mlx import MlxBackend

    return MlxBackend


def _mlx_features() -> type:
    from edgespec.backends.mlx_features import MlxFeatureBackend

    return MlxFeatureBackend


def _llama_hidden() -> type:
    from edgespec.backends.llama_hidden import LlamaHiddenBackend

    return LlamaHiddenBackend


def _mlx_hidden() -> type:
    from edgespec.backends.mlx_hidden import MlxHiddenBackend

    return MlxHiddenBackend


# (runtime, captures features) -> the backend class, imported on use (llama.cpp and MLX are extras)
_BACKENDS: dict[tuple[str, bool], Callable[[], type]] = {
    ("llama.cpp", False): _llama, ("llama.cpp", True): _llama_features,
    ("mlx", False): _mlx, ("mlx", True): _mlx_features}
# runtime -> the target that keeps its final-norm hidden states (Medusa heads)
_HIDDEN: dict[str, Callable[[], type]] = {"llama.cpp": _llama_hidden, "mlx": _mlx_hidden}


# -- open: drafters --------------------------------------------------------------------------------


def open_drafter(plan: DrafterPlan | Spec | None, target: Backend, backend: str = "llama.cpp", *,
                 impl: HeadImpl = "auto", **options: Any) -> Drafter | None:
    """The drafter `plan` names, drafting for `target` (a head's target opened with its layers).

    Args:
        plan: from `plan_drafter`, or a spec, planned here against the target (None: no drafter).
        target: the opened target.
        backend: the draft model's backend.
        impl: where a head runs (drafters.heads.open_head): "auto" takes the target's runtime (Medusa heads:
            drafters.medusa.open_medusa's choice).
        **options: as for LlamaCppBackend / MlxBackend; a libllama head takes `threads`.

    Raises:
        EdgespecError (VocabMismatchError) naming both files unless the drafter can draft for `target`.
    """
    if not isinstance(plan, DrafterPlan):
        plan = plan_drafter(plan, Path(target.path) if target is not None else None, backend)
    if plan is None:
        return None
    return _DRAFTERS[plan.kind](plan, target, backend, impl, options)


def _ngram(plan: DrafterPlan, *_: Any) -> Drafter:
    from edgespec.drafters.ngram import NgramDrafter

    try:
        return NgramDrafter(*plan.numbers)
    except ValueError as e:
        raise EdgespecError(f"bad n-gram drafter {plan.spec!r}: {e}") from None


def _history(plan: DrafterPlan, target: Backend, *_: Any) -> Drafter:
    """A HistoryDrafter, its corpus (if any) tokenized by the target."""
    from edgespec.drafters.history import HistoryDrafter

    docs = []
    if plan.corpus is not None:
        try:
            docs = [target.tokenize(plan.corpus.read_text(encoding="utf-8"), add_special=False)]
        except (OSError, UnicodeDecodeError) as e:
            raise EdgespecError(f"cannot read history corpus file {plan.corpus}: {e}") from None
    try:
        return HistoryDrafter(*plan.numbers, corpus_tokens=docs)
    except ValueError as e:
        raise EdgespecError(f"bad history drafter {plan.spec!r}: {e}") from None


def _head(plan: DrafterPlan, target: Backend, backend: str, impl: HeadImpl, options: dict[str, Any]) -> Drafter:
    assert plan.head is not None
    return open_head(plan.head, target, impl, options.get("threads"))


def _draft_model(plan: DrafterPlan, target: Backend, backend: str, impl: HeadImpl,
                 options: dict[str, Any]) -> Drafter:
    from edgespec.drafters.draft_model import DraftModelDrafter, check_vocab_compatible, open_kv_handoff

    assert plan.path is not None
    model = open_backend(plan.path, backend, **options)
    try:
        check_vocab_compatible(target, model)
        handoff = None
        if backend == "llama.cpp":  # a quantized copy of the target reads the target's cache (backends.llama_kv)
            handoff = open_kv_handoff(target, model)
    except BaseException:
        model.close()
        raise
    return DraftModelDrafter(model, target.n_vocab, handoff)


def _chain(plan: DrafterPlan, target: Backend, backend: str, impl: HeadImpl, options: dict[str, Any]) -> Drafter:
    """The members opened in order (a failure closes those opened before it)."""
    from contextlib import ExitStack

    from edgespec.drafters.chain import DrafterChain

    with ExitStack() as opened:
        drafters = []
        for m in plan.members:
            drafters.append(_DRAFTERS[m.kind](m, target, backend, impl, options))
            opened.callback(drafters[-1].close)
        opened.pop_all()
    return DrafterChain(drafters)


def _mtp(plan: DrafterPlan, target: Backend, backend: str, impl: HeadImpl, options: dict[str, Any]) -> Drafter:
    """The target's MTP head (on llama.cpp the target opened with `open_backend(..., mtp=True)`; on MLX a
    plain target whose final norm the drafter taps)."""
    if backend == "mlx":
        from edgespec.drafters.mtp_mlx import MlxMtpDrafter

        return MlxMtpDrafter(target)
    from edgespec.drafters.mtp import MtpDrafter

    return MtpDrafter(target, options.get("threads"))  # type: ignore[arg-type]  # checked there


def _assistant(plan: DrafterPlan, target: Backend, backend: str, impl: HeadImpl, options: dict[str, Any]) -> Drafter:
    """A Gemma-4 assistant on the target's context (the target opened with `open_backend(..., mtp=True)`)."""
    from edgespec.drafters.assistant import AssistantDrafter

    assert plan.path is not None
    return AssistantDrafter(plan.path, target, options.get("threads"))  # type: ignore[arg-type]  # checked there


def _medusa(plan: DrafterPlan, target: Backend, backend: str, impl: HeadImpl, options: dict[str, Any]) -> Drafter:
    """Medusa heads on a target opened with `open_backend(..., hidden=True)`, run in numpy ("llama": as on
    llama.cpp), on MLX ("mlx") or as drafters.medusa.open_medusa picks ("auto")."""
    from edgespec.drafters.medusa import open_medusa

    assert plan.path is not None
    return open_medusa(plan.path, target, {"llama": "numpy"}.get(impl, impl))  # type: ignore[arg-type]


_DRAFTERS: dict[str, Callable[..., Drafter]] = {"ngram": _ngram, "history": _history, "head": _head,
                                                "model": _draft_model, "chain": _chain, "mtp": _mtp,
                                                "assistant": _assistant, "medusa": _medusa}
