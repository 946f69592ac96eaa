"""Medusa drafting (Cai et al., ICML 2024, arXiv 2401.10774) on the llama.cpp and MLX backends.

Head k (k = 0..K−1) reads the target's final-norm hidden state h_t at position t, the row whose logits
chose the pending token x_{t+1}, and predicts x_{t+2+k} (heads.medusa). With the committed context
c_0..c_{N−1} (c_{N−1} pending, not yet in the target's KV cache) that row is position N−2, which the
target opened by ``open_backend(..., hidden=True)`` keeps: backends.llama_hidden.LlamaHiddenBackend on
llama.cpp, backends.mlx_hidden.MlxHiddenBackend on MLX. The backend-specific parts are that target
(``HiddenTarget``: its rows and, for heads sharing it, its LM head) and where the heads run (``HeadRunner``):
numpy (MedusaRunner, on either backend) or MLX (heads.medusa_mlx.MlxMedusaRunner, on an MLX target, calling
the target's own LM head); ``open_medusa`` picks: MLX where MLX computes on a GPU (Metal, CUDA), numpy on
mlx[cpu], where numpy's head is the faster (SmolLM2 here: 16 ms against 30).

* Chain (``draft``): token i is head i's argmax (greedy), or drawn from head i's processed distribution
  (sampling.process_rows, as for the target; its q row kept). Head i never sees the tokens drafted before
  it, so its q row does not depend on them: drawn tokens stay exact draws from q, as verification needs.
* Tree (``draft_tree``): Medusa's candidate tree. A node at depth d+1 takes one of head d's candidates,
  ranked by probability (greedy: the raw softmax; sampled: the processed distribution). The shape is the
  ``max_nodes`` rank paths (at most ``max_depth`` and K deep) of highest product of head probabilities, found best first (a node's first
  child and next sibling are never likelier than it, so the result is closed under parents and earlier
  siblings, and comes out in topological order). Greedy, the node of rank r holds head d's r-th likeliest
  token: first child = the chain's token, siblings in descending probability. Sampled, the shape is still
  chosen from the ranked probabilities alone (known before any draw), and the tokens of depth d+1 are one
  sequence drawn WITHOUT replacement from head d's processed distribution: a node of rank r holds its
  r-th draw (a node's candidates depend only on its depth, as the heads see no drafted token), and each
  node's q row is that distribution (edgespec.tree.DraftTree's convention).
"""

from __future__ import annotations

import heapq
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt

from edgespec.drafters.base import Chain, Draft, DraftCost
from edgespec.errors import EdgespecError, VocabMismatchError
from edgespec.heads.medusa import MedusaConfig, output_weight, read_medusa_gguf, res_bias, res_weight
from edgespec.sampling import SamplingParams, process_rows, sample
from edgespec.tree import DraftTree

F32 = npt.NDArray[np.float32]


class HiddenTarget(Protocol):
    """What the drafter reads from its target (backends.llama_hidden.LlamaHiddenBackend,
    backends.mlx_hidden.MlxHiddenBackend)."""

    path: str
    name: str  # the backend: "llama.cpp" or "mlx" (an MLX target also lends MlxBackend.lm_head)
    n_embd: int
    n_vocab: int

    def hidden(self, pos: int) -> F32 | None:
        """The final-norm hidden state (H,) of position `pos`, None where the target holds none."""
        ...

    def output_matrix(self) -> F32:
        """The target's LM head (V, H) float32 (numpy heads sharing it multiply by it)."""
        ...


class HeadRunner(Protocol):
    """K heads' forward, one head at a time: MedusaRunner (numpy), heads.medusa_mlx.MlxMedusaRunner."""

    n_heads: int
    n_embd: int
    n_vocab: int

    def logits(self, h: F32, k: int) -> F32:
        """Head k's logits (V,) from the target's final-norm hidden state h (H,)."""
        ...


class MedusaRunner:
    """K Medusa heads in float32 numpy, one head at a time (a chain cut short computes no more heads).

    Args:
        config: the heads' hyperparameters.
        tensors: GGUF tensor name → array (heads.medusa.MedusaConfig.shapes).
        lm_head: the target's output matrix (V, H), needed when ``config.shared_lm_head``.
    """

    def __init__(self, config: MedusaConfig, tensors: Mapping[str, npt.NDArray[Any]],
                 lm_head: npt.NDArray[Any] | None = None) -> None:
        config.check_tensors(tensors)
        self.config = config
        self.n_heads, self.n_embd, self.n_vocab = config.n_heads, config.n_embd, config.n_vocab
        f32 = lambda a: np.ascontiguousarray(a, np.float32)  # noqa: E731
        # x @ W.T as W (H_out, H_in) @ x: no transposed copies
        self._res = [[(f32(tensors[res_weight(k, j)]), f32(tensors[res_bias(k, j)])) for j in range(config.n_layers)]
                     for k in range(config.n_heads)]
        if config.shared_lm_head:
            want = (config.n_vocab, config.n_embd)
            if lm_head is None or tuple(lm_head.shape) != want:
                raise ValueError(f"Medusa heads sharing the target's LM head need it as a {want} matrix "
                                 f"(got {None if lm_head is None else tuple(lm_head.shape)})")
            shared = f32(lm_head)
            self._out = [shared] * config.n_heads
        else:
            self._out = [f32(tensors[output_weight(k)]) for k in range(config.n_heads)]

    def logits(self, h: F32, k: int) -> F32:
        """Head k's logits (V,) from the target's final-norm hidden state h (H,)."""
        x = np.asarray(h, np.float32)
        for w, b in self._res[k]:
            z = w @ x + b
            x = x + z / (1.0 + np.exp(-z))  # SiLU
        return self._out[k] @ x


class MedusaDrafter:
    """Chain and tree drafting with Medusa heads on a target that keeps its final-norm hidden states.

    Args:
        runner: the heads' forward (their vocabulary and hidden size the target's).
        target: the target (``hidden(pos)``); the engine keeps its KV cache at the context minus the
            pending token.
        path: the heads' GGUF (for `paths`; "" for in-memory heads).
    """

    name = "medusa"

    def __init__(self, runner: HeadRunner, target: HiddenTarget, path: str = "") -> None:
        self.runner, self.target = runner, target
        self.paths = (path,) if path else ()

    def hidden(self, context: Sequence[int]) -> F32 | None:
        """h_t for `context`: the target's row at position len(context) − 2 (whose logits chose the pending
        token); None for a one-token context or a position the target holds no row for."""
        n = len(context)
        return self.target.hidden(n - 2) if n >= 2 else None

    def draft(self, context: Sequence[int], gamma: int, params: SamplingParams, rng: np.random.Generator,
              stop: Callable[[Sequence[float]], bool] | None = None) -> Draft:
        """Propose at most min(gamma, K) tokens after `context` (see drafters.base.Drafter)."""
        h = self.hidden(context) if gamma > 0 else None
        if h is None:
            return Draft([])
        chain = Chain(params, rng, stop)
        for k in range(min(gamma, self.runner.n_heads)):
            if chain.step(self.runner.logits(h, k)) is None:
                break
        return chain.draft(0)

    def draft_tree(self, context: Sequence[int], max_nodes: int, max_depth: int, params: SamplingParams,
                   rng: np.random.Generator, stop: Callable[[Sequence[float]], bool] | None = None) -> DraftTree:
        """Medusa's candidate tree of at most `max_nodes` nodes, none deeper than min(`max_depth`, K), after
        `context` (see the module doc)."""
        h = self.hidden(context) if max_nodes > 0 and max_depth > 0 else None
        if h is None:
            return DraftTree([], [])
        ranked: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]] = []  # per depth: ids, probs
        rows: list[npt.NDArray[np.float64] | None] = []  # per depth: the processed q row (None: greedy)
        for k in range(min(self.runner.n_heads, max_nodes, max_depth)):
            logits = self.runner.logits(h, k).astype(np.float64)
            if params.greedy:
                p, q = np.exp(logits - logits.max()), None
                p /= p.sum()
                ids = np.argsort(-logits, kind="stable")[:max_nodes]  # ties: the lower id, as argmax
            else:
                p = q = process_rows(logits[None], params)[0].dense()
                ids = np.argsort(-p, kind="stable")[: min(max_nodes, int(np.count_nonzero(p)))]
            ranked.append((ids, p[ids]))
            rows.append(q)
        paths, scores = best_paths([pr for _, pr in ranked], max_nodes)
        index = {path: i for i, path in enumerate(paths)}
        parents = [index[path[:-1]] if len(path) > 1 else -1 for path in paths]
        scores = [s / (scores[par] if par >= 0 else 1.0) for s, par in zip(scores, parents)]  # at the parent
        if params.greedy:
            tokens = [int(ranked[len(path) - 1][0][path[-1]]) for path in paths]
            return DraftTree(tokens, parents, None, scores)
        need = [0] * len(ranked)  # draws needed per depth: its largest rank + 1
        for path in paths:
            need[len(path) - 1] = max(need[len(path) - 1], path[-1] + 1)
        draws = [draw_without_replacement(q, m, rng) if q is not None and m else [] for q, m in zip(rows, need)]
        tokens = [draws[len(path) - 1][path[-1]] for path in paths]
        q = np.stack([rows[len(path) - 1] for path in paths]) if paths else None
        return DraftTree(tokens, parents, q, scores)

    def measure_ms_per_head(self, repeats: int = 8) -> float:
        """Median ms of one head's forward and its argmax: the scheduler's prior per draft token."""
        h = np.zeros(self.runner.n_embd, np.float32)
        times = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            int(np.argmax(self.runner.logits(h, i % self.runner.n_heads)))
            times.append(time.perf_counter() - t0)
        return 1000 * statistics.median(times[1:])  # the first call warms caches

    def cost_prior(self, note: Callable[[str], None] | None = None) -> DraftCost:
        """A chain of `measure_ms_per_head()` head forwards (h_t itself comes with the target's pass)."""
        return DraftCost(0.0, self.measure_ms_per_head())

    def reset(self) -> None:
        """Nothing cached: every draft reads the target's row for its context."""

    def close(self) -> None:
        """Nothing native held."""


def best_paths(probs: Sequence[npt.NDArray[np.float64]], max_nodes: int) -> tuple[list[tuple[int, ...]], list[float]]:
    """The at most `max_nodes` rank paths (r_1, ..., r_d) of highest product probs[0][r_1]···probs[d−1][r_d]
    (each probs[d] descending, zero-probability ranks never taken), best first, and their products.
    Popped in that order, every path comes after its parent and its earlier siblings (topological)."""
    out: list[tuple[int, ...]] = []
    scores: list[float] = []
    heap: list[tuple[float, tuple[int, ...], float]] = []  # (−product, path, parent's product)
    if probs and len(probs[0]) and probs[0][0] > 0:
        heap.append((-float(probs[0][0]), (0,), 1.0))
    while heap and len(out) < max_nodes:
        neg, path, base = heapq.heappop(heap)
        score, d, r = -neg, len(path) - 1, path[-1]
        out.append(path)
        scores.append(score)
        if r + 1 < len(probs[d]) and probs[d][r + 1] > 0:  # the next sibling
            heapq.heappush(heap, (-base * float(probs[d][r + 1]), (*path[:-1], r + 1), base))
        if d + 1 < len(probs) and len(probs[d + 1]) and probs[d + 1][0] > 0:  # the first child
            heapq.heappush(heap, (-score * float(probs[d + 1][0]), (*path, 0), score))
    return out, scores


def draw_without_replacement(q: npt.NDArray[np.float64], m: int, rng: np.random.Generator) -> list[int]:
    """m distinct ids drawn one after another from q, each from q without the earlier draws, renormalised
    (m ≤ the number of ids with q > 0)."""
    p, out = q.copy(), []
    for _ in range(m):
        x = sample(p / p.sum(), rng)
        out.append(x)
        p[x] = 0.0
    return out


# -- opening ------------------------------------------------------------------------------------------------


def read_medusa_header(path: str | Path) -> MedusaConfig:
    """The config of a medusa GGUF, read from its header (one-line EdgespecError if unreadable)."""
    from edgespec.gguf_file import read_gguf

    try:
        f = read_gguf(Path(path).expanduser(), lambda k: k.startswith(("general.", "medusa.")), with_tensors=False)
        return MedusaConfig(n_heads=int(f.arch_value("num_heads")), n_layers=int(f.arch_value("num_layers")),
                            n_embd=int(f.arch_value("hidden_size")), n_vocab=int(f.arch_value("vocab_size")),
                            shared_lm_head=bool(f.arch_value("shared_lm_head", False)))
    except (ValueError, OSError, KeyError, TypeError) as e:
        raise EdgespecError(f"cannot read the Medusa heads {path}: {e}") from None


def check_medusa_fit(config: MedusaConfig, path: str | Path, target: str | Path, n_embd: int | None,
                     n_vocab: int | None) -> None:
    """One-line errors naming both files unless the heads' hidden size and vocabulary are the target's
    (None: unknown, not checked)."""
    if n_embd is not None and n_embd != config.n_embd:
        raise EdgespecError(f"Medusa heads {path} were made for a target of hidden size {config.n_embd}, but "
                            f"target {target} has hidden size {n_embd}")
    if n_vocab is not None and n_vocab != config.n_vocab:
        raise VocabMismatchError(f"Medusa heads {path} have a vocabulary of {config.n_vocab} tokens, but target "
                                 f"{target} has {n_vocab}")


def check_medusa_target_header(path: str | Path, target: Path) -> MedusaConfig:
    """The heads' config, checked against the target GGUF's header (before any weights load)."""
    from edgespec.gguf_file import read_gguf

    config = read_medusa_header(path)
    keep = lambda k: k in ("general.architecture", "tokenizer.ggml.tokens") or k.endswith(  # noqa: E731
        (".embedding_length", ".vocab_size"))
    try:
        meta = read_gguf(target, keep, with_tensors=False) if target.is_file() else None
    except (ValueError, OSError):
        meta = None  # the backend reports what is wrong with the file
    if meta is not None:
        arch = meta.value("general.architecture")
        tokens = meta.value("tokenizer.ggml.tokens")
        n_vocab = meta.value(f"{arch}.vocab_size") or (len(tokens) if tokens else None)
        check_medusa_fit(config, path, target, meta.value(f"{arch}.embedding_length"), n_vocab)
    return config


def open_medusa(path: str | Path, target: Any, runtime: Literal["auto", "numpy", "mlx"] = "auto") -> MedusaDrafter:
    """A MedusaDrafter of the heads in `path` for `target` (opened with ``hidden=True``), the heads run by
    `runtime` ("mlx": an MLX target's; "auto": that where MLX computes on a GPU, else numpy); one-line errors
    for a target that keeps no hidden states, does not fit the heads, or is no MLX target for "mlx"."""
    if not callable(getattr(target, "hidden", None)):
        raise EdgespecError(f"Medusa heads {path} need a target opened with its hidden states, as edgespec.load "
                            f"and `--drafter` open it (target {target.path})")
    if runtime == "mlx" and target.name != "mlx":
        raise EdgespecError(f"Medusa heads {path} run on MLX with an MLX target only (target {target.path} is on "
                            f"{target.name})")
    try:
        config, tensors = read_medusa_gguf(Path(path).expanduser())
    except (ValueError, OSError) as e:
        raise EdgespecError(f"cannot read the Medusa heads {path}: {e}") from None
    check_medusa_fit(config, path, target.path, target.n_embd, target.n_vocab)
    if runtime == "auto":
        from edgespec.heads.medusa_mlx import mlx_on_gpu

        runtime = "mlx" if target.name == "mlx" and mlx_on_gpu() else "numpy"
    runner: HeadRunner
    if runtime == "mlx":
        from edgespec.heads.medusa_mlx import MlxMedusaRunner

        runner = MlxMedusaRunner(config, tensors, target.lm_head() if config.shared_lm_head else None)
    else:
        runner = MedusaRunner(config, tensors, target.output_matrix() if config.shared_lm_head else None)
    return MedusaDrafter(runner, target, str(path))
