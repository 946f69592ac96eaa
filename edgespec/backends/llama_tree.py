"""Draft-tree verification on llama.cpp: the target scores a whole tree in ONE llama_decode.

A tree is a root (the pending last committed token, not yet in the KV cache) and n nodes in
topological order, `parents[i]` node i's parent (-1: the root), as edgespec.tree.DraftTree holds
them. `eval_tree` returns n+1 logit rows: row 0 after the root, row i+1 after node i, each computed
with tree attention: a node sees the context, its ancestors and itself, at position n_past + depth
(the root at n_past). `keep_path` then commits the root and the accepted nodes to the context and
drops every other node's cells.

How, on llama.cpp's own terms (the pinned 0.3.36 sources; examples/speculative's tree drafts work so):
one sequence id per leaf (1..L; the context lives in seq 0), and each token of the batch carries the
ids of all leaves under it, so the cells of a shared prefix are shared. A cell is visible to a query
token when the cell holds the query's `seq_id[0]` and its position is not past the query's
(src/llama-kv-cache.cpp, set_input_kq_mask_impl: `seq_id = ubatch->seq_id[i][0]`,
`cells.seq_has(j, seq_id)`, `p0 > p1` masked). A token's ids come from an unordered set
(llama-batch.h, llama_batch_ext::token::seq_ids), so which one is `seq_id[0]` is unspecified; any
will do: a leaf under node i lies below exactly i's ancestors, and of the nodes on that leaf's path
only i and its ancestors sit at positions up to i's. The context is first copied into every leaf's
sequence (llama_memory_seq_cp from seq 0: metadata only in one stream); the batch checks then hold
(llama-batch.cpp init: each sequence continues its last position, coupled sequences share their
memory range, positions rise along each sequence). The sequences must share one KV stream, so the
context is created with kv_unified and n_seq_max = 1 + leaves (LlamaCppBackend(tree_leaves=L));
without it llama.cpp gives each sequence its own stream of n_ctx / n_seq_max cells, and the tree's
decode fails (llama_decode 1: split_equal refuses coupled sequences, llama-batch.cpp). Plain decoding
on such a context is unchanged, bit for bit (tests/test_tree_llama.py).

Holes: keep_path frees the rejected nodes' cells, and llama.cpp puts later tokens into the first free
cells (llama-kv-cache.cpp find_slot). A hole before a kept cell is thus filled by a later position,
and CPU flash attention, which walks the cells in index order, then gives results that differ from a
cache filled in order by up to ~4e-4 of the logit range (measured on the tiny F32 llama, F32 and F16 KV;
without flash attention ~1e-7); what the rejected nodes held has no effect, bit for bit. The batch
is laid out in depth-first preorder (`preorder`), so an accepted first-child chain (the drafter's
first choices) leaves no such hole and decoding continues bit for bit as on a cache that never held
the tree. Any other path is evaluated again in order instead (one forward of its length), so that
after `keep_path` the cache is always the plain one, bit for bit.

A target that keeps its final-norm rows (backends.llama_hidden, for Medusa) or its feature rows
(backends.llama_features, for EAGLE-3, DFlash and DSpark heads) is told of the tree's rows
(`note_tree`) and of the path kept (`keep_tree_path`); a feature target whose capture missed the tree's
rows has the kept path evaluated again in order, which stores them.

A pending tree is invisible to seq 0 (its cells never hold seq 0), so plain eval/truncate on the
backend are unaffected by it; `keep_path` or `drop_tree` clears it, and the next `eval_tree` drops a
tree left pending. Attention-only targets: a recurrent state cannot branch this way.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from edgespec.backends.base import check_room
from edgespec.backends.llama_cpp import LlamaCppBackend
from edgespec.errors import BackendError


@dataclass(frozen=True)
class _Pending:
    """A tree evaluated and not yet committed: where its root sits, its shape, one leaf sequence
    below each node (index 0: the root, i+1: node i)."""

    n_past: int
    root: int
    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    leaf_seq: tuple[int, ...]


_pending: weakref.WeakKeyDictionary[LlamaCppBackend, _Pending] = weakref.WeakKeyDictionary()


def tree_seqs(parents: Sequence[int]) -> list[list[int]]:
    """The leaf sequence ids (1..L, leaves in index order) under the root (index 0) and under each
    node (index i+1): the seq ids its token carries. Checks the topological order."""
    n = len(parents)
    has_child = [False] * (n + 1)
    for i, par in enumerate(parents):
        if not -1 <= par < i:
            raise ValueError(f"draft tree: node {i}'s parent {par} is neither -1 (the root) nor an earlier node")
        has_child[par + 1] = True
    seqs: list[list[int]] = [[] for _ in range(n + 1)]
    leaf = 0
    for k in range(n + 1):
        if not has_child[k]:
            leaf += 1
            seqs[k].append(leaf)
    for i in range(n - 1, -1, -1):  # children after parents: fold each node's leaves into its parent's
        seqs[parents[i] + 1].extend(seqs[i + 1])
    return [sorted(s) for s in seqs]


def preorder(parents: Sequence[int]) -> list[int]:
    """Rows (0: the root, i+1: node i) in depth-first preorder, children in index order: the batch
    order. The first-child chain then takes the first cells, so when it (or its start) is accepted,
    the freed cells all lie after the kept ones (see the module's note on holes)."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, par in enumerate(parents):
        kids[par + 1].append(i + 1)
    out, stack = [], [0]
    while stack:
        k = stack.pop()
        out.append(k)
        stack.extend(reversed(kids[k]))
    return out


def eval_tree(backend: LlamaCppBackend, root: int, tokens: Sequence[int],
              parents: Sequence[int]) -> npt.NDArray[np.float32]:
    """The target's logits (n+1, n_vocab) float32 for the root and the n nodes (`tokens[i]` under
    `parents[i]`), scored in one llama_decode with tree attention. backend.n_past does not change;
    `keep_path` commits the accepted path."""
    if backend.recurrent:
        raise BackendError(f"draft trees need an attention-only target: {backend.path} has recurrent layers")
    n = len(tokens)
    if len(parents) != n:
        raise ValueError(f"draft tree: {n} tokens but {len(parents)} parents")
    seqs = tree_seqs(parents)
    n_leaves, ll, mem, ctx = len(seqs[0]), backend._ll, backend._mem, backend._ctx
    if n_leaves > ll.llama_n_seq_max(ctx) - 1:
        raise BackendError(f"a draft tree of {n_leaves} leaves needs LlamaCppBackend(tree_leaves >= {n_leaves}) "
                           f"(this one has {ll.llama_n_seq_max(ctx) - 1})")
    if n + 1 > backend.n_batch:
        raise BackendError(f"a draft tree of {n + 1} tokens does not fit one batch of {backend.n_batch}")
    n_past = backend.n_past
    check_room(n_past, n + 1, backend.n_ctx)
    drop_tree(backend)
    for s in range(1, n_leaves + 1):
        ll.llama_memory_seq_cp(mem, 0, s, -1, -1)
    depth = [0] * (n + 1)
    for i, par in enumerate(parents):
        depth[i + 1] = depth[par + 1] + 1
    order, toks = preorder(parents), (root, *tokens)
    batch = ll.llama_batch_init(n + 1, 0, n_leaves)
    try:
        batch.n_tokens = n + 1
        for b, k in enumerate(order):
            batch.token[b] = int(toks[k])
            batch.pos[b] = n_past + depth[k]
            batch.n_seq_id[b] = len(seqs[k])
            for j, s in enumerate(seqs[k]):
                batch.seq_id[b][j] = s
            batch.logits[b] = True
        rc = ll.llama_decode(ctx, batch)
    finally:
        ll.llama_batch_free(batch)
    if rc != 0:
        drop_tree(backend)
        raise BackendError(f"llama_decode returned {rc} for a draft tree of {n + 1} tokens at position {n_past}")
    _pending[backend] = _Pending(n_past, int(root), tuple(int(t) for t in tokens), tuple(parents),
                                 tuple(s[0] for s in seqs))
    if hasattr(backend, "note_tree"):  # a target that keeps its hidden rows (llama_hidden: Medusa)
        backend.note_tree(parents)
    out = np.empty((n + 1, backend.n_vocab), np.float32)
    out[order] = backend._logit_rows(n + 1)  # batch row b is tree row order[b]
    return out


def keep_path(backend: LlamaCppBackend, path: Sequence[int]) -> None:
    """Commit the root and the nodes of `path` (node indices from a child of the root down, as
    tree.verify_tree returns them) to the context; drop every other node's cells. backend.n_past
    grows by 1 + len(path)."""
    pending = _pending.pop(backend, None)
    if pending is None or pending.n_past != backend.n_past:
        drop_tree(backend)
        raise BackendError("keep_path: no draft tree evaluated at this position (call eval_tree first)")
    node = -1
    for i in path:
        if not 0 <= i < len(pending.parents) or pending.parents[i] != node:
            drop_tree(backend)
            raise ValueError(f"keep_path: {list(path)} is not a path from the root of the evaluated tree")
        node = i
    first, node = [], -1  # the first-child chain as deep as the path
    for _ in path:
        node = pending.parents.index(node) if node in pending.parents else -2
        first.append(node)
    missed = getattr(backend, "tree_rows_missing", None)  # a feature target whose capture missed the tree
    if list(path) == first and not (missed is not None and missed()):  # first in the batch: no hole before them
        ll, mem, end = backend._ll, backend._mem, pending.n_past + 1 + len(path)
        # the cells of a leaf below the last accepted node, at positions up to it, are exactly the path's
        ll.llama_memory_seq_cp(mem, pending.leaf_seq[path[-1] + 1 if path else 0], 0, pending.n_past, end)
        ll.llama_memory_seq_keep(mem, 0)
        backend._n_past = end
    else:  # holes would reorder flash attention's sums (module note): the path again, in order
        drop_tree(backend)
        backend.eval([pending.root, *(pending.tokens[i] for i in path)], rows="none")
    if hasattr(backend, "keep_tree_path"):
        backend.keep_tree_path(path)


def drop_tree(backend: LlamaCppBackend) -> None:
    """Forget a pending tree: every cell that seq 0 does not hold is freed (llama_memory_seq_keep)."""
    _pending.pop(backend, None)
    backend._ll.llama_memory_seq_keep(backend._mem, 0)
