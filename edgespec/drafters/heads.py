"""Feature heads (EAGLE-3, DFlash, DSpark) as drafters: a head GGUF's header, its checks against the
target, and the head drafter on the runtime that runs it.

Both head formats store llama.cpp's extract ids in ``<arch>.target_layers``: id L is the INPUT of
target layer L (the output of layer L−1), which is what LlamaFeatureBackend / MlxFeatureBackend
capture for a layer id L, so the ids are passed through unchanged. (DFlash's HF configs count
``target_layer_ids`` from the layer outputs; llama.cpp's converter writes them + 1.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from edgespec.backends.base import Backend
from edgespec.drafters.base import Drafter, FeatureTarget
from edgespec.errors import EdgespecError, ModelLoadError, VocabMismatchError

HeadImpl = Literal["auto", "numpy", "llama", "mlx"]
Spec = str | os.PathLike[str]


@dataclass(frozen=True)
class _HeadKind:
    name: str  # in messages
    hidden_key: str  # <arch>.<key>: the target hidden size the head was made for
    n_layers: int | None  # how many target layers it must read (None: one or more)


HEAD_KINDS = {"eagle3": _HeadKind("EAGLE-3", "target_hidden_size", 3),
              "dflash": _HeadKind("DFlash", "embedding_length", None)}  # general.architecture → kind


@dataclass(frozen=True)
class HeadFile:
    """A feature-head GGUF's header: which target layers it reads and what target it was made for."""

    path: str  # as the user named it (messages quote it)
    arch: str  # "eagle3" or "dflash"
    meta: Any  # gguf_file.GGUFFile: general.*, <arch>.*, token texts; tensors listed, not loaded

    @property
    def kind(self) -> str:
        return HEAD_KINDS[self.arch].name

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self.meta.value(f"{self.arch}.target_layers", []))

    @property
    def hidden(self) -> int | None:
        return self.meta.value(f"{self.arch}.{HEAD_KINDS[self.arch].hidden_key}")


def head_arch(path: Spec) -> str | None:
    """general.architecture of a GGUF file (reads the header only); None for anything else."""
    p = Path(path).expanduser()
    if not p.is_file():  # "ngram", a model name: no need to import the gguf package (~3.5 MiB)
        return None
    from edgespec.gguf_file import read_gguf

    try:
        f = read_gguf(p, lambda k: k == "general.architecture", with_tensors=False)
    except (ValueError, OSError):
        return None
    arch = f.value("general.architecture")
    return arch if isinstance(arch, str) else None


def is_feature_head(spec: Spec | None) -> bool:
    """Whether `spec` is an EAGLE-3 or DFlash head GGUF or checkpoint directory (whose target must
    capture features)."""
    return spec is not None and (head_arch(spec) in HEAD_KINDS or is_head_dir(spec))


def is_head_dir(spec: Spec) -> bool:
    if not Path(spec).expanduser().is_dir():  # "ngram", a GGUF file, a model name
        return False
    from edgespec.heads.convert import is_head_checkpoint

    return is_head_checkpoint(spec)


def converted(spec: Spec, target: Spec | None) -> Spec:
    """A head checkpoint directory becomes its GGUF for `target` (converted once, cached and
    announced on stderr, as MLX conversions are); any other spec stays as it is."""
    if not is_head_dir(spec):
        return spec
    import sys

    from edgespec.heads.convert import cached_head
    from edgespec.models import DEFAULT_TARGET

    return str(cached_head(spec, target or DEFAULT_TARGET, note=lambda line: print(line, file=sys.stderr)))


def read_head(spec: Spec) -> HeadFile | None:
    """The header of `spec` if it is an EAGLE-3 or DFlash head GGUF, else None; a head whose
    target layers are unusable is a ModelLoadError."""
    arch = head_arch(spec)
    if arch not in HEAD_KINDS:
        return None
    from edgespec.gguf_file import read_gguf

    kind, keep = HEAD_KINDS[arch], ("general.", f"{arch}.", "tokenizer.ggml.tokens")
    try:
        head = HeadFile(str(spec), arch, read_gguf(Path(spec).expanduser(), lambda k: k.startswith(keep)))
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"cannot read the {kind.name} head {spec}: {e}") from None
    raw = head.meta.value(f"{arch}.target_layers")
    if not raw or (kind.n_layers is not None and len(raw) != kind.n_layers):
        expected = f", expected {kind.n_layers} ids" if kind.n_layers else ""
        raise ModelLoadError(f"{spec} is not a usable {kind.name} head: {arch}.target_layers is {raw!r}{expected}")
    return head



def check_target_header(head: HeadFile, path: Path) -> None:
    """Refuse a target whose header (read before its weights load) does not fit the head."""
    from edgespec.gguf_file import read_gguf

    try:
        meta = read_gguf(path, lambda k: k == "general.architecture" or k.endswith((".embedding_length", ".block_count")),
                         with_tensors=False) if path.is_file() else None
    except (ValueError, OSError):
        meta = None  # the backend reports what is wrong with the file
    if meta is None:
        return
    t_arch = meta.value("general.architecture")
    n_embd, n_layer = meta.value(f"{t_arch}.embedding_length"), meta.value(f"{t_arch}.block_count")
    if head.hidden is not None and n_embd is not None and n_embd != head.hidden:
        raise EdgespecError(f"{head.kind} head {head.path} was made for a target of hidden size {head.hidden}, but "
                            f"target {path} has hidden size {n_embd}")
    if n_layer is not None and not all(1 <= lid < n_layer for lid in head.layers):
        raise EdgespecError(f"{head.kind} head {head.path} reads target layers {head.layers}, but target {path} has "
                            f"{n_layer} layers (ids 1..{n_layer - 1} can be read)")



def check_head(head: HeadFile, target: Backend) -> None:
    """Raise a one-line error unless `head` was made for `target`: a target that captures the head's
    layers, of the head's hidden size, with the same vocabulary size and token texts; an EAGLE-3
    head without token embeddings borrows the target's, so its own hidden size must be H_t too."""
    kind = head.kind
    if not isinstance(target, FeatureTarget):
        raise EdgespecError(f"{kind} head {head.path} needs a target opened with its features, as edgespec.load "
                            f"and `generate/chat/bench/profile --drafter` open it (target {target.path})")
    if tuple(target.feature_layers) != head.layers:
        raise EdgespecError(f"{kind} head {head.path} reads target layers {head.layers}, but target {target.path} "
                            f"captures {tuple(target.feature_layers)}")
    if head.hidden != target.n_embd:
        raise EdgespecError(f"{kind} head {head.path} was made for a target of hidden size {head.hidden}, but "
                            f"target {target.path} has hidden size {target.n_embd}")
    tokens = head.meta.value("tokenizer.ggml.tokens") or []
    n_vocab = head.meta.value(f"{head.arch}.vocab_size") or len(tokens)
    if n_vocab != target.n_vocab:
        raise VocabMismatchError(f"{kind} head {head.path} has a vocabulary of {n_vocab} tokens, but target "
                                 f"{target.path} has {target.n_vocab}")
    text = target.vocab_fingerprint().token_text
    first = next((i for i in range(5, min(len(tokens), target.n_vocab)) if tokens[i] != text(i)), None)
    if first is not None:  # llama.cpp's rule: token texts agree from id 5 on
        raise VocabMismatchError(f"{kind} head {head.path} cannot draft for target {target.path}: first differing "
                                 f"token {first}: {tokens[first]!r} vs {text(first)!r}")
    n_embd = head.meta.value("eagle3.embedding_length")
    if head.arch == "eagle3" and "token_embd.weight" not in head.meta.tensors and n_embd != head.hidden:
        raise EdgespecError(f"EAGLE-3 head {head.path} has no token embeddings of its own and hidden size {n_embd}: "
                            f"it can borrow the target's only if that equals the target's {head.hidden}")


def open_head(head: HeadFile, target: Backend, impl: HeadImpl, threads: int | None) -> Drafter:
    """Check `head` against `target`, then run it where `impl` says (see `open_drafter`)."""
    from edgespec.backends.llama_cpp import LlamaCppBackend
    from edgespec.backends.mlx import MlxBackend

    if impl not in ("auto", "numpy", "llama", "mlx"):
        raise ValueError(f"impl must be 'auto', 'numpy', 'llama' or 'mlx' (got {impl!r})")
    check_head(head, target)
    assert isinstance(target, FeatureTarget)  # check_head refuses any other target
    on_llama = impl == "llama" or (impl == "auto" and isinstance(target, LlamaCppBackend))
    on_mlx = impl == "mlx" or (impl == "auto" and isinstance(target, MlxBackend))
    if on_llama and not isinstance(target, LlamaCppBackend):
        raise EdgespecError(f"the libllama {head.kind} head needs a llama.cpp target (got {target.name})")
    path = Path(head.path).expanduser()
    if head.arch == "eagle3":
        from edgespec.drafters.eagle import EagleDrafter

        if on_llama:
            from edgespec.heads.eagle3_llama import LlamaEagle3Head

            return EagleDrafter(LlamaEagle3Head(path, target, threads=threads), target, head.path)
        from edgespec.heads.gguf_io import read_eagle3_gguf

        config, tensors = read_eagle3_gguf(path)
        embd = None if "token_embd.weight" in tensors else _target_matrices(target, on_mlx, need_output=False)[0]
        if on_mlx:
            from edgespec.heads.eagle3_mlx import MlxEagle3Head

            return EagleDrafter(MlxEagle3Head(config, tensors, tok_embd=embd), target, head.path)
        from edgespec.heads.eagle3 import Eagle3Head

        return EagleDrafter(Eagle3Head(config, tensors, tok_embd=embd), target, head.path)
    from edgespec.drafters.dflash import DFlashDrafter, DFlashRunner
    from edgespec.heads.dflash_gguf import read_dflash_gguf
    from edgespec.heads.dspark import MarkovHead

    dspark = "markov_w1.weight" in head.meta.tensors
    if dspark or not on_llama:  # the libllama DSpark head needs the Markov weights host-side too
        config, tensors = read_dflash_gguf(path)
    markov = MarkovHead(config, tensors) if dspark else None
    runner: DFlashRunner
    if on_llama:
        from edgespec.heads.dflash_llama import LlamaDFlashHead

        runner = LlamaDFlashHead(path, target, threads=threads, markov=markov)
    else:
        embd = output = None
        if "token_embd.weight" not in tensors:  # borrowed from the target, as llama.cpp does
            embd, output = _target_matrices(target, on_mlx, need_output="output.weight" not in tensors)
        if on_mlx:
            from edgespec.heads.dflash_mlx import MlxDFlashHead

            runner = MlxDFlashHead(config, tensors, tok_embd=embd, output=output)
        else:
            from edgespec.heads.dflash import DFlashHead

            runner = DFlashHead(config, tensors, tok_embd=embd, output=output)
    if markov is None:
        return DFlashDrafter(runner, target, head.path)
    from edgespec.drafters.dspark import DSparkDrafter

    return DSparkDrafter(runner, target, markov, head.path)  # type: ignore[arg-type]  # both heads have forward_block


def _target_matrices(target: FeatureTarget, as_mx: bool, need_output: bool) -> tuple[Any, Any]:
    """The target's token embeddings (V, H) and, if `need_output`, its LM head (V, H) (else None):
    an MLX feature target's own mx weights for an MLX head (no copies), else its GGUF's tensors."""
    if as_mx:
        from edgespec.backends.mlx_features import MlxFeatureBackend

        if isinstance(target, MlxFeatureBackend):
            return target.token_embeddings(), (target.lm_head_weights() if need_output else None)
    from edgespec.gguf_file import read_gguf

    t = read_gguf(target.path)
    embd = t.tensor("token_embd.weight")
    if not need_output:
        return embd, None
    return embd, (t.tensor("output.weight") if "output.weight" in t.tensors else embd)
