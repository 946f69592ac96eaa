"""DFlash drafting: a block-parallel head proposes up to B−1 tokens in one forward pass.

The pairing is llama.cpp's (common/speculative.cpp ``common_speculative_impl_draft_dflash``,
0.3.36), restated for edgespec's view of the context: the committed context c_0..c_{N-1}
(c_{N-1} is the pending token, not yet in the target's KV cache) fills head positions
P = 0..N-2 with the target's fused features f_P (injected as K/V). A draft of n ≤ B−1 tokens is
one block [c_{N-1}, MASK×n] at positions N-1..N-1+n, whose rows 1..n give the logits of
x̃₁..x̃ₙ (llama.cpp decodes n_max + 1 block tokens the same way). The rows are computed together,
so q_i depends on the context only, never on x̃_{<i}: sampling each x̃ᵢ from q_i and verifying
with those q rows is exact speculative sampling.

The head's cache is synced to each call's context by common prefix, like EagleDrafter's: rows of
positions whose tokens changed are dropped and re-injected from the target's features, so partial
rejection, full acceptance and new prompts need no special case. The block's own K/V never stay.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

from edgespec.backends.base import Backend
from edgespec.drafters.base import Draft, DraftCost, confidence
from edgespec.drafters.eagle import FeatureTarget
from edgespec.drafters.feature_heads import check_feature_target, head_arch, head_meta, open_feature_target
from edgespec.errors import EdgespecError, ModelLoadError
from edgespec.sampling import SamplingParams, process, sample

F32 = npt.NDArray[np.float32]
HeadImpl = Literal["auto", "numpy", "llama", "mlx"]


class DFlashRunner(Protocol):
    """What the drafter needs from a head: heads.dflash.DFlashHead (numpy),
    heads.dflash_mlx.MlxDFlashHead (MLX) or heads.dflash_llama.LlamaDFlashHead (libllama)."""

    @property
    def n_past(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    def inject(self, features: F32) -> Any: ...

    def truncate(self, n_past: int) -> None: ...

    def block_tokens(self, anchor: int, n: int | None = None) -> list[int]: ...

    def block_logits(self, tokens: Sequence[int]) -> F32: ...


class DFlashDrafter:
    """Block drafting with a DFlash head: greedy takes each block row's argmax, sampling draws each
    position from its processed distribution (sampling.process, as for the target) and returns
    those q rows.

    Args:
        head: the head (its logits must span the target's vocabulary).
        target: the target backend whose features the head reads; the engine keeps its KV cache at
            the context minus the pending token, which is what `sync` needs.
    """

    name = "dflash"

    def __init__(self, head: DFlashRunner, target: FeatureTarget) -> None:
        self.head, self.target = head, target
        self._ctx: list[int] = []  # the tokens of head positions 0..n_past-1
        self._synced = 0

    def sync(self, context: Sequence[int]) -> None:
        """Bring the head's context cache to the features of `context` minus its last token."""
        n = len(context) - 1
        if self.target.n_past < n:
            raise EdgespecError(f"the DFlash drafter needs target features of the {n} context tokens before "
                                f"the last, but the target has evaluated {self.target.n_past}")
        common = 0
        for a, b in zip(self._ctx, context):
            if a != b:
                break
            common += 1
        keep = max(0, min(common, n, self.head.n_past))
        self.head.truncate(keep)
        self._ctx = list(context[:keep])
        if keep < n:
            self.head.inject(self.target.features(keep, n))
        self._ctx = list(context[:n])
        self._synced = max(0, n - keep - 1)  # rows beyond the one a cycle normally adds

    def draft(self, context: Sequence[int], gamma: int, params: SamplingParams, rng: np.random.Generator,
              stop: Callable[[Sequence[float]], bool] | None = None) -> Draft:
        """Propose at most min(`gamma`, B−1) tokens after `context` (see drafters.base.Drafter)."""
        n = min(gamma, self.head.block_size - 1)
        if n <= 0 or not context:
            return Draft([])
        self.sync(context)
        row = self._rows(context[-1], n)
        tokens: list[int] = []
        q_rows: list[npt.NDArray[np.float64]] = []
        conf: list[float] = []
        prev = context[-1]
        for i in range(n):
            logits, head_conf = row(i, prev)
            q = None if params.greedy else process(logits, params)
            conf.append(confidence(logits, q) if head_conf is None else head_conf)
            if stop is not None and stop(conf):
                conf.pop()
                break
            prev = int(np.argmax(logits)) if q is None else sample(q, rng)
            tokens.append(prev)
            if q is not None:
                q_rows.append(q)
        return Draft(tokens, np.stack(q_rows) if q_rows else None, conf, self._synced)

    def _rows(self, anchor: int, n: int) -> Callable[[int, int], tuple[F32, float | None]]:
        """Run the block of `n` drafts after `anchor`; returns row(i, prev): the logits (V,) of draft
        i (0-based) given the token drafted before it, and the head's own confidence in it (None:
        derived from the logits by drafters.base.confidence). DFlash's rows ignore prev."""
        rows = self.head.block_logits(self.head.block_tokens(anchor, n + 1))[1:]  # (n, V)
        return lambda i, prev: (rows[i], None)

    def measure_ms_per_token(self, repeats: int = 8) -> float:
        """The median ms of a block of g + 1 tokens and its argmaxes, divided by its g drafts,
        g = min(4, B−1) (the scheduler's slow start; a block's cost grows slowly with g, so this
        overestimates longer drafts: the scheduler uses `measure_draft_cost`)."""
        g = min(4, self.head.block_size - 1)
        return self._time_block(g, repeats) / g

    def measure_draft_cost(self, repeats: int = 8) -> DraftCost:
        """The scheduler's prior: a block of γ drafts costs fixed + γ·per_token ms, the line through
        the median times of blocks of 1 and B−1 drafts (one forward either way: mostly fixed)."""
        g = self.head.block_size - 1
        one = self._time_block(1, repeats)
        per_token = max(0.0, (self._time_block(g, repeats) - one) / (g - 1)) if g > 1 else 0.0
        return DraftCost(max(0.0, one - per_token), per_token, block=True)

    def _time_block(self, g: int, repeats: int) -> float:
        """Median ms of a block of g + 1 tokens and its argmaxes, timed after the cached context;
        the block leaves the cache as it was."""
        n_ctx = getattr(self.head, "n_ctx", None)  # the libllama head's context
        if n_ctx is not None and self.head.n_past + g + 1 > n_ctx:
            self._ctx = []  # no room after the cached context: forget it
            self.head.truncate(0)
        tokens = self.head.block_tokens(0, g + 1)
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            self.head.block_logits(tokens)[1:].argmax(axis=1)
            times.append(time.perf_counter() - t0)
        return 1000 * statistics.median(times[1:])  # the first call warms caches

    def close(self) -> None:
        close = getattr(self.head, "close", None)
        if close is not None:
            close()


# -- opening a head file ------------------------------------------------------------------------------


def is_dflash_head(path: str | os.PathLike) -> bool:
    """Whether `path` is a GGUF file whose general.architecture is "dflash" (reads the header only)."""
    return head_arch(path) == "dflash"


def dflash_target_layers(path: str | os.PathLike) -> tuple[int, ...]:
    """The target layer ids a DFlash head reads (dflash.target_layers: llama.cpp extract ids, the
    INPUT of each target layer, as the feature backends take them)."""
    layers = head_meta(path, "dflash").value("dflash.target_layers")
    if not layers:
        raise ModelLoadError(f"{path} is not a usable DFlash head: dflash.target_layers is {layers!r}")
    return tuple(int(x) for x in layers)


def open_dflash_target(target: str | os.PathLike, head: str | os.PathLike, backend: str = "llama.cpp",
                       **options: Any) -> Backend:
    """Open a target that captures the features `head` reads (LlamaFeatureBackend, or
    MlxFeatureBackend with backend="mlx"): its layers, refused unless the target's hidden size is
    the head's (llama.cpp's dflash requires H == H_t) and the ids are in 1..n_layer−1.

    Args:
        target: the target GGUF path or known model name (on "mlx" also an mlx-lm directory).
        head: the DFlash head GGUF.
        backend: "llama.cpp" or "mlx".
        **options: as for LlamaCppBackend / MlxBackend (n_ctx, threads, n_gpu_layers, verbose).
    """
    hidden = head_meta(head, "dflash").value("dflash.embedding_length")
    return open_feature_target(target, head, "dflash", dflash_target_layers(head), hidden, backend, **options)


def check_dflash_head(head: str | os.PathLike, target: Backend) -> None:
    """Raise a one-line error unless `head` was made for `target`: a target that captures the head's
    layers, hidden size == the head's, the same vocabulary size and token texts."""
    f = head_meta(head, "dflash")
    check_feature_target(f, "dflash", head, target, f.value("dflash.embedding_length"))


def open_dflash_drafter(head: str | os.PathLike, target: Backend, *, impl: HeadImpl = "auto",
                        threads: int | None = None) -> DFlashDrafter:
    """A DFlashDrafter for `head` on `target` (opened by open_dflash_target), after check_dflash_head;
    a DSparkDrafter when the head has DSpark's Markov head (markov_w1.weight).

    Args:
        head: the DFlash head GGUF.
        target: the feature target.
        impl: "llama" runs the head on libllama (LlamaDFlashHead, tested equal to numpy), "mlx" on MLX
            (MlxDFlashHead, tested equal to numpy; token embeddings / LM head the head lacks are an
            MLX target's own weights), "numpy" on the numpy reference (those read from the target's
            GGUF); "auto" takes libllama for a llama.cpp target, MLX for an MLX target, numpy
            otherwise. A DSpark head's Markov head runs in numpy on every impl.
        threads: CPU threads of the libllama head (default: the target's).
    """
    from edgespec.backends.llama_cpp import LlamaCppBackend
    from edgespec.backends.mlx import MlxBackend

    if impl not in ("auto", "numpy", "llama", "mlx"):
        raise ValueError(f"impl must be 'auto', 'numpy', 'llama' or 'mlx' (got {impl!r})")
    check_dflash_head(head, target)
    from edgespec.heads.dflash_gguf import read_dflash_gguf
    from edgespec.heads.dspark import MarkovHead

    on_llama = impl == "llama" or (impl == "auto" and isinstance(target, LlamaCppBackend))
    on_mlx = impl == "mlx" or (impl == "auto" and isinstance(target, MlxBackend))
    dspark = "markov_w1.weight" in head_meta(head, "dflash").tensors
    if dspark or not on_llama:  # the libllama DSpark head needs the Markov weights host-side too
        config, tensors = read_dflash_gguf(Path(head).expanduser())
    markov = MarkovHead(config, tensors) if dspark else None
    runner: DFlashRunner
    if on_llama:
        from edgespec.heads.dflash_llama import LlamaDFlashHead

        if not isinstance(target, LlamaCppBackend):
            raise EdgespecError(f"the libllama DFlash head needs a llama.cpp target (got {target.name})")
        runner = LlamaDFlashHead(head, target, threads=threads, markov=markov)
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
        return DFlashDrafter(runner, target)
    from edgespec.drafters.dspark import DSparkDrafter

    return DSparkDrafter(runner, target, markov)  # type: ignore[arg-type]  # both heads have forward_block


def _target_matrices(target: Backend, as_mx: bool, need_output: bool) -> tuple[Any, Any]:
    """The target's token embeddings (V, H) and, if `need_output`, its LM head (V, H) (else None):
    an MLX feature target's own mx weights for the MLX head (no copies), else its GGUF's tensors."""
    if as_mx and hasattr(target, "lm_head_weights"):
        return target.token_embeddings(), (target.lm_head_weights() if need_output else None)
    from edgespec.heads.gguf_io import read_gguf

    t = read_gguf(target.path)
    embd = t.tensor("token_embd.weight")
    if not need_output:
        return embd, None
    return embd, (t.tensor("output.weight") if "output.weight" in t.tensors else embd)
