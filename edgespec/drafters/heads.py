"""Feature heads (EAGLE-3, DFlash, DSpark) as drafters: a head GGUF's header, its checks against the
target, and HEAD_RUNTIMES, the table of which head kind runs on which runtime (docs/heads.md).

Both head formats store llama.cpp's extract ids in ``<arch>.target_layers``: id L is the INPUT of
target layer L (the output of layer L−1), which is what LlamaFeatureBackend / MlxFeatureBackend
capture for a layer id L, so the ids are passed through unchanged. (DFlash's HF configs count
``target_layer_ids`` from the layer outputs; llama.cpp's converter writes them + 1.)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from edgespec.backends.base import Backend, FeatureBackend
from edgespec.drafters.base import Drafter
from edgespec.errors import EdgespecError, ModelLoadError, VocabMismatchError

Runtime = Literal["llama", "mlx"]  # libllama (heads/*_llama.py), mlx.core ops (heads/*_mlx.py)
HeadImpl = Literal["auto", "llama", "mlx"]  # "auto": the target's own runtime
Spec = str | os.PathLike[str]
KIND_NAMES = {"eagle3": "EAGLE-3", "dflash": "DFlash", "dspark": "DSpark"}  # HeadFile.variant → its name


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
    def variant(self) -> str:
        """The kind HEAD_RUNTIMES is keyed by: the architecture, "dspark" for a DFlash head with a Markov head."""
        return "dspark" if self.arch == "dflash" and "markov_w1.weight" in self.meta.tensors else self.arch

    @property
    def file(self) -> Path:
        return Path(self.path).expanduser()

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
    if not isinstance(target, FeatureBackend):
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


def open_head(head: HeadFile, target: Backend, impl: HeadImpl = "auto", threads: int | None = None) -> Drafter:
    """Check `head` against `target`, then build its drafter on the runtime `impl` names ("auto": the
    target's own, DEFAULT_RUNTIME) from HEAD_RUNTIMES; a kind × runtime not in the table is a one-line
    EdgespecError naming the runtimes the kind has."""
    check_head(head, target)
    assert isinstance(target, FeatureBackend)  # check_head refuses any other target
    runtime = DEFAULT_RUNTIME.get(target.name, target.name) if impl == "auto" else impl
    build = HEAD_RUNTIMES.get((head.variant, runtime))
    if build is None:
        have = ", ".join(r for k, r in HEAD_RUNTIMES if k == head.variant)
        raise EdgespecError(f"{KIND_NAMES[head.variant]} head {head.path} cannot run on {runtime!r}: "
                            f"{KIND_NAMES[head.variant]} heads run on {have}")
    return build(head, target, threads)


def _eagle3_llama(head: HeadFile, target: FeatureBackend, threads: int | None) -> Drafter:
    from edgespec.drafters.eagle import EagleDrafter
    from edgespec.heads.eagle3_llama import LlamaEagle3Head

    return EagleDrafter(LlamaEagle3Head(head.file, _llama_target(head, target), threads=threads), target, head.path)


def _eagle3_mlx(head: HeadFile, target: FeatureBackend, threads: int | None) -> Drafter:
    from edgespec.drafters.eagle import EagleDrafter
    from edgespec.heads.eagle3_mlx import MlxEagle3Head
    from edgespec.heads.gguf_io import read_eagle3_gguf

    config, tensors = read_eagle3_gguf(head.file)
    embd = None if "token_embd.weight" in tensors else _target_matrices(target, need_output=False)[0]
    return EagleDrafter(MlxEagle3Head(config, tensors, tok_embd=embd), target, head.path)


def _block_llama(head: HeadFile, target: FeatureBackend, threads: int | None) -> Drafter:
    """A DFlash or DSpark head on libllama (a DSpark head's Markov head runs host-side, read from its GGUF)."""
    from edgespec.heads.dflash_gguf import read_dflash_gguf
    from edgespec.heads.dflash_llama import LlamaDFlashHead
    from edgespec.heads.dspark import MarkovHead

    markov = MarkovHead(*read_dflash_gguf(head.file)) if head.variant == "dspark" else None
    runner = LlamaDFlashHead(head.file, _llama_target(head, target), threads=threads, markov=markov)
    return _block_drafter(runner, target, head, markov)


def _block_mlx(head: HeadFile, target: FeatureBackend, threads: int | None) -> Drafter:
    """A DFlash or DSpark head in mlx.core ops (the Markov head in numpy)."""
    from edgespec.heads.dflash_gguf import read_dflash_gguf
    from edgespec.heads.dflash_mlx import MlxDFlashHead
    from edgespec.heads.dspark import MarkovHead

    config, tensors = read_dflash_gguf(head.file)
    embd = output = None
    if "token_embd.weight" not in tensors:  # borrowed from the target, as llama.cpp does
        embd, output = _target_matrices(target, need_output="output.weight" not in tensors)
    runner = MlxDFlashHead(config, tensors, tok_embd=embd, output=output)
    return _block_drafter(runner, target, head, MarkovHead(config, tensors) if head.variant == "dspark" else None)


# (kind, runtime) → the factory of its drafter: the one place that says which head runs where. A new
# kind or runtime adds its rows here (docs/heads.md); numpy references of the heads are test oracles.
HEAD_RUNTIMES: dict[tuple[str, Runtime], Callable[[HeadFile, FeatureBackend, int | None], Drafter]] = {
    ("eagle3", "llama"): _eagle3_llama, ("eagle3", "mlx"): _eagle3_mlx,
    ("dflash", "llama"): _block_llama, ("dflash", "mlx"): _block_mlx,
    ("dspark", "llama"): _block_llama, ("dspark", "mlx"): _block_mlx,
}
DEFAULT_RUNTIME: dict[str, Runtime] = {"llama.cpp": "llama", "mlx": "mlx"}  # Backend.name → what "auto" picks


def _block_drafter(runner: Any, target: FeatureBackend, head: HeadFile, markov: Any) -> Drafter:
    from edgespec.drafters.dflash import DFlashDrafter
    from edgespec.drafters.dspark import DSparkDrafter

    if markov is None:
        return DFlashDrafter(runner, target, head.path)
    return DSparkDrafter(runner, target, markov, head.path)


def _llama_target(head: HeadFile, target: FeatureBackend) -> Any:
    """`target` as the llama.cpp backend a libllama head shares its weights with (ctx_other)."""
    from edgespec.backends.llama_cpp import LlamaCppBackend

    if not isinstance(target, LlamaCppBackend):
        raise EdgespecError(f"the libllama {head.kind} head needs a llama.cpp target (got {target.name})")
    return target


def _target_matrices(target: FeatureBackend, need_output: bool) -> tuple[Any, Any]:
    """The target's token embeddings (V, H) and, if `need_output`, its LM head (V, H) (else None): the
    backend's own arrays where it lends them (an MLX target's mx weights: no copies), else its GGUF's."""
    embd = target.token_embeddings()
    if embd is not None:
        return embd, (target.lm_head_weights() if need_output else None)
    from edgespec.gguf_file import read_gguf

    t = read_gguf(target.path)
    embd = t.tensor("token_embd.weight")
    if not need_output:
        return embd, None
    return embd, (t.tensor("output.weight") if "output.weight" in t.tensors else embd)
