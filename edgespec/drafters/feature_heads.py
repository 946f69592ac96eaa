"""What the feature-head drafters (EAGLE-3, DFlash) share about head files: recognising one by its
GGUF architecture, reading its metadata, opening a target that captures the features it reads,
and checking it against an opened target with one-line errors.

Both head formats store llama.cpp's extract ids in ``<arch>.target_layers``: id L is the INPUT of
target layer L (the output of layer L−1), which is what LlamaFeatureBackend / MlxFeatureBackend
capture for a layer id L, so the ids are passed through unchanged. (DFlash's HF configs count
``target_layer_ids`` from the layer outputs; llama.cpp's converter writes them + 1.)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from edgespec.backends.base import Backend
from edgespec.errors import EdgespecError, ModelLoadError, VocabMismatchError

HEAD_KINDS = {"eagle3": "EAGLE-3", "dflash": "DFlash"}  # general.architecture → name in messages


def head_arch(path: str | os.PathLike) -> str | None:
    """general.architecture of a GGUF file (reads the header only); None for anything else."""
    p = Path(path).expanduser()
    if not p.is_file():  # "ngram", a model name: no need to import the gguf package (~3.5 MiB)
        return None
    from edgespec.heads.gguf_io import read_gguf

    try:
        f = read_gguf(p, lambda k: k == "general.architecture", with_tensors=False)
    except (ValueError, OSError):
        return None
    arch = f.value("general.architecture")
    return arch if isinstance(arch, str) else None


def is_feature_head(path: str | os.PathLike) -> bool:
    """Whether `path` is an EAGLE-3 or DFlash head GGUF."""
    return head_arch(path) in HEAD_KINDS


def head_meta(path: str | os.PathLike, arch: str) -> Any:
    """The head's general.*, <arch>.* and token texts (a gguf_io GGUF; tensors listed, not loaded)."""
    from edgespec.heads.gguf_io import read_gguf

    keep = ("general.", f"{arch}.", "tokenizer.ggml.tokens")
    try:
        return read_gguf(Path(path).expanduser(), lambda k: k.startswith(keep))
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"cannot read the {HEAD_KINDS[arch]} head {path}: {e}") from None


def open_feature_target(target: str | os.PathLike, head: str | os.PathLike, arch: str, layers: Sequence[int],
                        hidden: int | None, backend: str = "llama.cpp", **options: Any) -> Backend:
    """Open a target capturing `layers` (LlamaFeatureBackend, or MlxFeatureBackend on "mlx"), after
    checking its header: hidden size == `hidden` (when known) and layer ids in 1..n_layer−1."""
    from edgespec.heads.gguf_io import read_gguf
    from edgespec.models import resolve_model

    if backend not in ("llama.cpp", "mlx"):
        raise EdgespecError(f"unknown backend {backend!r} (choose from llama.cpp, mlx)")
    kind, layers = HEAD_KINDS[arch], tuple(layers)
    path = resolve_model(str(target))
    try:  # hidden size and depth from the target's header, before its weights load
        meta = read_gguf(path, lambda k: k == "general.architecture" or k.endswith((".embedding_length", ".block_count")),
                         with_tensors=False) if path.is_file() else None
    except (ValueError, OSError):
        meta = None  # the backend reports what is wrong with the file
    if meta is not None:
        t_arch = meta.value("general.architecture")
        n_embd, n_layer = meta.value(f"{t_arch}.embedding_length"), meta.value(f"{t_arch}.block_count")
        if hidden is not None and n_embd is not None and n_embd != hidden:
            raise EdgespecError(f"{kind} head {head} was made for a target of hidden size {hidden}, but target "
                                f"{path} has hidden size {n_embd}")
        if n_layer is not None and not all(1 <= lid < n_layer for lid in layers):
            raise EdgespecError(f"{kind} head {head} reads target layers {layers}, but target {path} has "
                                f"{n_layer} layers (ids 1..{n_layer - 1} can be read)")
    if backend == "mlx":
        from edgespec.backends.mlx_features import MlxFeatureBackend

        return MlxFeatureBackend(path, layers=layers, **options)
    from edgespec.backends.llama_features import LlamaFeatureBackend

    return LlamaFeatureBackend(path, layers=layers, **options)


def check_feature_target(f: Any, arch: str, head: str | os.PathLike, target: Backend, hidden: int | None) -> None:
    """Raise a one-line error unless the head whose metadata is `f` was made for `target`: a target
    that captures the head's layers, hidden size `hidden`, the same vocabulary size and token texts."""
    kind = HEAD_KINDS[arch]
    layers = tuple(int(x) for x in f.value(f"{arch}.target_layers", []))
    got = getattr(target, "feature_layers", None)
    if got is None:
        raise EdgespecError(f"{kind} head {head} needs a target opened with its features, as edgespec.load and "
                            f"`generate/chat/bench/profile --drafter` open it (target {target.path})")
    if tuple(got) != layers:
        raise EdgespecError(f"{kind} head {head} reads target layers {layers}, but target {target.path} "
                            f"captures {tuple(got)}")
    tgt_embd = getattr(target, "n_embd", None)
    if hidden != tgt_embd:
        raise EdgespecError(f"{kind} head {head} was made for a target of hidden size {hidden}, but target "
                            f"{target.path} has hidden size {tgt_embd}")
    tokens = f.value("tokenizer.ggml.tokens") or []
    n_vocab = f.value(f"{arch}.vocab_size") or len(tokens)
    if n_vocab != target.n_vocab:
        raise VocabMismatchError(f"{kind} head {head} has a vocabulary of {n_vocab} tokens, but target "
                                 f"{target.path} has {target.n_vocab}")
    text = target.vocab_fingerprint().token_text
    first = next((i for i in range(5, min(len(tokens), target.n_vocab)) if tokens[i] != text(i)), None)
    if first is not None:  # llama.cpp's rule: token texts agree from id 5 on
        raise VocabMismatchError(f"{kind} head {head} cannot draft for target {target.path}: first differing "
                                 f"token {first}: {tokens[first]!r} vs {text(first)!r}")


def open_head_target(target: str | os.PathLike, head: str | os.PathLike, backend: str = "llama.cpp",
                     **options: Any) -> Backend:
    """The feature target an EAGLE-3 or DFlash head needs (open_eagle3_target / open_dflash_target)."""
    if head_arch(head) == "dflash":
        from edgespec.drafters.dflash import open_dflash_target

        return open_dflash_target(target, head, backend, **options)
    from edgespec.drafters.eagle import open_eagle3_target

    return open_eagle3_target(target, head, backend, **options)
