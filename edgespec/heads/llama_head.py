"""What the libllama-run feature heads (EAGLE-3, DFlash) share: a head GGUF loaded as a llama.cpp
model, its own context (``ctx_other`` = the target's context when there is a target, so a head
without token embeddings or LM head reads the target model's), one ext batch reused per call, and
a KV cache of ``n_past`` positions on sequence 0 that ``truncate`` rolls back.

Tree entries (``tree_seqs`` > 0, EAGLE-3's batched tree steps): cells beside the context that seq 0 never
holds, each reached through sequence ids, as the target's tree verification reaches its nodes
(backends.llama_tree: a unified KV cache, context cells shared by llama_memory_seq_cp, a cell shown to a
query whose first sequence id it holds at a position not past the query's). Entry e's cell holds its own
id, which holds exactly the cells e sees (the context, the entries e saw) and e's, so a later row that sees
what e saw and e copies that id to its own (``_tree_rows``); a keeper id holds every entry's cell, so that
ids can be recycled without freeing a cell in the middle (a hole the next entries would fill before their
ancestors, reordering flash attention's sums). ``n_past`` counts the context's positions and then the
entries; ``truncate`` drops the entries whole (llama_memory_seq_keep(0)), which leaves the cache exactly
as the context alone left it.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from edgespec.backends.llama_cpp import (
    KV_TYPES,
    LlamaCppBackend,
    LlamaHandles,
    check_gguf_file,
    load_failure_reason,
    model_metadata,
)
from edgespec.backends.llama_features import ExtApi, ext_api
from edgespec.errors import BackendError, ModelLoadError

F32 = npt.NDArray[np.float32]
ENCODE, DECODE = 0, 1  # enum llama_process_type


class LlamaHeadContext(LlamaHandles):
    """A head model and its llama.cpp context, attached to a target context or standalone.

    Args:
        path: the head GGUF.
        target: the target backend; its context becomes the head context's ``ctx_other`` and must
            outlive this object. None: a standalone context (the head must carry its own token
            embeddings and LM head: llama.cpp refuses a context otherwise).
        kind: the head's name in errors ("EAGLE-3", "DFlash").
        n_ctx, n_batch: context and batch size (default: the target's; standalone 4096 and 512).
            The batch is also the ubatch: a non-causal or encoder pass needs its rows in one ubatch.
        kv_type: the head's KV cache type ("f16", llama.cpp's default, or "f32", "q8_0").
        flash_attn: llama.cpp's flash attention (on CPU it rounds Q·K to F16).
        threads: CPU threads (default: the target's; standalone 1).
        tree_seqs: sequence ids for tree entries beside seq 0 (one of them the keeper; 0: none, one
            sequence, no unified cache). Plain decoding is unchanged by them, bit for bit.

    ``close()`` frees the head's model, context and batch (LlamaHandles).
    """

    def __init__(self, path: str | os.PathLike, target: LlamaCppBackend | None, *, kind: str,
                 n_ctx: int | None = None, n_batch: int | None = None, kv_type: str = "f16",
                 flash_attn: bool = True, threads: int | None = None, tree_seqs: int = 0) -> None:
        super().__init__()
        ll = self._ll
        api = ext_api()
        if api is None:
            raise BackendError(f"this libllama does not export the ext API a {kind} head needs")
        self._api: ExtApi = api
        p = Path(path).expanduser()
        check_gguf_file(p)
        self.path = p
        self._load_model(p, ll.llama_model_default_params(), "load")
        self.target_layers = api.model_target_layers(self._model)
        self.n_embd = ll.llama_model_n_embd(self._model)
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self._model))
        self.n_batch = n_batch or (target.n_batch if target is not None else 512)
        cp = ll.llama_context_default_params()
        cp.n_ctx = n_ctx or (target.n_ctx if target is not None else 4096)
        cp.n_batch = cp.n_ubatch = self.n_batch
        cp.n_seq_max, cp.kv_unified = 1 + tree_seqs, tree_seqs > 0  # one stream: ids share cells (llama_tree)
        cp.n_threads = cp.n_threads_batch = threads or (target.threads if target is not None else 1)
        cp.type_k = cp.type_v = KV_TYPES[kv_type]
        cp.flash_attn_type = -1 if flash_attn else 0  # AUTO / DISABLED
        cp.no_perf = True
        if target is not None:
            cp.ctx_other = target.llama_context
        self._ctx = ll.llama_init_from_model(self._model, cp)
        if not self._ctx:
            self.close()
            raise ModelLoadError(f"cannot create a llama.cpp context for the {kind} head {p}: {load_failure_reason(p)}")
        self.n_ctx = ll.llama_n_ctx(self._ctx)
        self._mem = ll.llama_get_memory(self._ctx)
        self._batch, self._free_batch = ll.llama_batch_ext_init(self._ctx), ll.llama_batch_ext_free
        self._target = target  # keeps ctx_other alive as long as this head
        self._n_past = 0  # the context's positions (seq 0)
        self._keeper = tree_seqs  # the id every tree entry's cell holds
        self._entries: list[tuple[int, int, frozenset[int]]] = []  # tree entries: (own id, position, entries seen)
        self._owner: dict[int, int] = {}  # id → the entry it identifies, oldest first
        self._free = list(range(1, tree_seqs))

    @property
    def n_past(self) -> int:
        """Entries in the head's KV cache: the context's positions, then the tree entries."""
        return self._n_past + len(self._entries)

    def metadata(self, key: str) -> str | None:
        """The head model's metadata value as text, None if absent."""
        return model_metadata(self._ll, self._model, key)

    def _embd(self, row: F32) -> Any:
        """A llama_embd view of one float32 row (the row must stay alive until the batch runs)."""
        return self._ll.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, row.shape[0])

    def _set_pos(self, idx: int, pos: tuple[int, int, int, int]) -> bool:
        """Set the 4 position rows of batch entry `idx` (rows 1..3 matter only for M-RoPE)."""
        return bool(self._ll.llama_batch_ext_set_pos(self._batch, idx, (self._ll.llama_pos * 4)(*pos)))

    def _process(self, kind: int, what: str) -> None:
        rc = self._ll.llama_process(self._ctx, kind, self._batch)
        if rc != 0:
            raise BackendError(f"llama_process({what}) returned {rc}")

    def _logits(self, n: int) -> F32:
        """Logits rows 0..n-1 of the last pass, (n, V) float32 (copied)."""
        ll = self._ll
        return np.stack([np.ctypeslib.as_array(ll.llama_get_logits_ith(self._ctx, i), shape=(self.n_vocab,))
                         for i in range(n)]).astype(np.float32)

    def _seq_rm(self, n_past: int) -> None:
        if not self._ll.llama_memory_seq_rm(self._mem, 0, n_past, -1):
            raise BackendError(f"llama_memory_seq_rm could not roll the head back to {n_past}")

    def truncate(self, n_past: int) -> None:
        """Drop the head's KV entries ≥ n_past: tree entries only whole (n_past ≤ the context's)."""
        if n_past >= self.n_past:
            return
        if self._entries:
            if n_past > self._n_past:
                raise BackendError(f"the head's tree entries are dropped whole: truncate to at most {self._n_past}")
            self._ll.llama_memory_seq_keep(self._mem, 0)
            self._entries.clear()
            self._owner.clear()
            self._free = list(range(1, self._keeper))
        if n_past < self._n_past:
            self._seq_rm(n_past)
            self._n_past = n_past

    def _tree_rows(self, positions: Sequence[int], visible: npt.NDArray[np.bool_]) -> list[int]:
        """A fresh id for each new row (n rows after the n_past entries held), holding the cells its row
        of `visible` ((n, n_past + n)) shows: the whole context, then nothing or an entry e and what e saw,
        at positions[row] one past e's (the context's end). Ids are reused oldest first, never one a row
        copies; an entry whose id was reused can no longer be seen (ValueError)."""
        if self._keeper < 2:
            raise BackendError("this head context has no sequence ids for tree entries (tree_seqs < 2)")
        n, held, ctx = len(positions), self.n_past, self._n_past
        vis = np.asarray(visible, bool)
        if vis.shape != (n, held + n):
            raise ValueError(f"a tree step of {n} rows needs a ({n}, {held + n}) mask (got {vis.shape})")
        srcs = []
        for r in range(n):
            row, seen = vis[r], frozenset(int(e) for e in np.flatnonzero(vis[r, ctx:held]))
            if not row[:ctx].all() or not row[held + r] or row[held:].sum() != 1:
                raise ValueError(f"tree row {r} must see the whole context, itself and no other new row")
            if not seen:
                src, pos = 0, ctx
            else:
                e = max(seen)
                own, pos_e, saw = self._entries[e]
                if saw != seen - {e} or self._owner.get(own) != e:
                    raise ValueError(f"tree row {r} sees entries {sorted(seen)}: not an entry and what it saw "
                                     f"(or the entry's id was reused)")
                src, pos = own, pos_e + 1
            if positions[r] != pos:
                raise ValueError(f"tree row {r} is at position {positions[r]}, not {pos} (one past what it sees)")
            srcs.append(src)
        ids = []
        while len(ids) < n:
            if self._free:
                ids.append(self._free.pop(0))
                continue
            old = next((s for s in self._owner if s not in srcs), None)
            if old is None:
                raise BackendError(f"a tree step of {n} rows needs more than the head's {self._keeper - 1} tree ids")
            del self._owner[old]
            self._ll.llama_memory_seq_rm(self._mem, old, -1, -1)  # the keeper still holds its cell
            ids.append(old)
        for src, s in zip(srcs, ids, strict=True):
            self._ll.llama_memory_seq_cp(self._mem, src, s, -1, -1)
        return ids

    def _tree_commit(self, ids: Sequence[int], positions: Sequence[int], visible: npt.NDArray[np.bool_]) -> None:
        """Record the rows `_tree_rows` gave `ids` as entries once their pass ran (the keeper takes each
        new cell: the only one its id holds at its position)."""
        held, ctx, vis = self.n_past, self._n_past, np.asarray(visible, bool)
        for r, (s, pos) in enumerate(zip(ids, positions, strict=True)):
            self._ll.llama_memory_seq_cp(self._mem, s, self._keeper, pos, pos + 1)
            self._owner[s] = held + r - ctx
            self._entries.append((s, int(pos), frozenset(int(e) for e in np.flatnonzero(vis[r, ctx:held]))))

    def _tree_abort(self, ids: Sequence[int]) -> None:
        """Free the ids `_tree_rows` gave a tree step whose pass failed (its cells were not kept)."""
        for s in ids:
            self._ll.llama_memory_seq_rm(self._mem, s, -1, -1)
            self._free.append(s)
