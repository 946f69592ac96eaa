"""An EAGLE-3 head GGUF run by libllama itself, the way llama.cpp's common/speculative.cpp drives it.

The head is loaded as a llama.cpp model (arch ``eagle3``) and gets its own context whose
``ctx_other`` is the target's context: a head without ``token_embd`` reads the target model's
token embeddings through it (llama.cpp refuses to create the context otherwise). Two passes:

* encode: ``llama_process(ENCODE)`` on rows of target features (3·H_t wide) → g rows, read back with
  ``llama_get_embeddings_nextn`` (the fc output; ext API, mangled name);
* decode: ``llama_process(DECODE)`` on (token, g) pairs at explicit positions → logits over the
  target vocabulary (−inf outside d2t) and the pre-norm hidden state
  (``llama_get_embeddings_nextn_ith``), which is the next g when drafting on.

A head with ``rope_freqs.weight`` (llama3 RoPE scaling) needs nothing here: llama.cpp's eagle3 graph
loads it as ``layers[0].rope_freqs`` and passes it to ggml_rope_ext as freq_factors.

Same interface as the numpy ``Eagle3Head`` (encode / decode / truncate / n_past), so the two can be
compared on the same inputs, and ``decode_tree`` as heads.eagle3_mlx's: EAGLE-2's batched tree step, the
rows of one depth in one ``llama_process`` at their own positions, each on its own sequence id that holds
the context and its ancestors' cells (heads.llama_head: tree entries).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

from edgespec.backends.llama_cpp import LlamaCppBackend
from edgespec.errors import BackendError, ModelLoadError
from edgespec.heads.llama_head import DECODE, ENCODE, F32, LlamaHeadContext

TREE_SEQS = 17  # ids for tree entries: the keeper and 16 rows (EAGLE-2's k = 4 per depth, twice over with room)


class LlamaEagle3Head(LlamaHeadContext):
    """An EAGLE-3 head on llama.cpp, attached to a target context.

    Args:
        path: the head GGUF (llama.cpp's eagle3 layout).
        target: the target backend; its context becomes the head context's ``ctx_other`` and must
            outlive this object.
        kv_type: the head's KV cache type ("f16", llama.cpp's default, or "f32", "q8_0").
        flash_attn: llama.cpp's flash attention (on CPU it rounds Q·K to F16).
        threads: CPU threads (default: the target's).
    """

    def __init__(self, path: str | os.PathLike, target: LlamaCppBackend, *, kv_type: str = "f16",
                 flash_attn: bool = True, threads: int | None = None) -> None:
        super().__init__(path, target, kind="EAGLE-3", kv_type=kv_type, flash_attn=flash_attn, threads=threads,
                         tree_seqs=TREE_SEQS)
        if len(self.target_layers) != 3:
            self.close()
            raise ModelLoadError(f"{self.path} is not an EAGLE-3 head (target layers {self.target_layers})")
        self.n_embd_tgt = self._ll.llama_model_n_embd(target.llama_model)
        self._api.set_nextn(self._ctx, True, True)  # pre-norm rows for the outputs asked for

    def encode(self, features: F32) -> F32:
        """fc over target features: (n, 3·H_t) → g (n, H), in chunks of n_batch rows (one ubatch each:
        the encoder needs its rows in one)."""
        self._no_tree("encode")
        ll, f = self._ll, np.ascontiguousarray(features, np.float32)
        if f.ndim != 2 or f.shape[1] != 3 * self.n_embd_tgt:
            raise ValueError(f"features must be (n, {3 * self.n_embd_tgt}) (got {f.shape})")
        out = []
        for start in range(0, len(f), self.n_batch):
            chunk = f[start:start + self.n_batch]
            ll.llama_batch_ext_clear(self._batch)
            for i, row in enumerate(chunk):
                idx = ll.llama_batch_ext_add_embd(self._batch, 0, self._embd(row))
                # the encoder ignores positions, but llama.cpp checks that a batch continues the
                # head's KV cache (Y = X + 1), as common/speculative.cpp's placeholders do. The
                # encoder stores nothing in that cache, so EVERY chunk starts at n_past: a later
                # chunk at n_past + start is refused (-1) whenever the cache holds a position
                if idx < 0 or not self._set_pos(idx, (self._n_past + i, 0, 0, 0)):
                    raise BackendError(f"cannot add feature row {start + i} to the encoder batch ({idx})")
                ll.llama_batch_ext_set_output_embd(self._batch, idx, True)
            self._process(ENCODE, f"encode {len(chunk)} rows")
            ptr = self._api.get_nextn(self._ctx)
            out.append(np.ctypeslib.as_array(ptr, shape=(len(chunk), self.n_embd)).copy())
        return np.concatenate(out) if out else np.empty((0, self.n_embd), np.float32)

    def decode(self, tokens: Sequence[int], g: F32, rows: Literal["all", "last"] = "all") -> tuple[F32, F32]:
        """The decoder on pairs (tokens[i], g[i]) at positions n_past+i (appended to the head's KV),
        in batches of at most n_batch pairs (a prompt longer than n_batch is synced in several).

        Args:
            rows: outputs for every pair, or only the last (the LM head dominates the cost: measured
                on SmolLM2 with V_d 8192, 1.5 ms for one pair, 4.4 ms for three with all outputs).

        Returns:
            (logits (k, V) with −inf outside the draft vocabulary, pre-norm h (k, H)); k = n or 1.
        """
        self._no_tree("decode")
        g = np.ascontiguousarray(g, np.float32)
        n = len(tokens)
        if g.shape != (n, self.n_embd):
            raise ValueError(f"g must be ({n}, {self.n_embd}) for {n} tokens (got {g.shape})")
        if rows == "last" and n > 1:
            # 0.3.36's eagle3 graph selects no output rows: a batch whose only output is its last pair
            # gets the FIRST pair's logits and h (measured). Like common/speculative.cpp, run the
            # pairs before it without outputs, then the last alone.
            for start in range(0, n - 1, self.n_batch):
                end = min(start + self.n_batch, n - 1)
                self._run(tokens[start:end], g[start:end], outputs=False)
            return self._run(tokens[-1:], g[-1:], outputs=True)
        if n <= self.n_batch:
            return self._run(tokens, g, outputs=True)
        parts = [self._run(tokens[s:s + self.n_batch], g[s:s + self.n_batch], outputs=True)
                 for s in range(0, n, self.n_batch)]
        return np.concatenate([z for z, _ in parts]), np.concatenate([h for _, h in parts])

    def _run(self, tokens: Sequence[int], g: F32, outputs: bool) -> tuple[F32, F32]:
        """One llama_process(DECODE) of the pairs, with outputs for all of them or none."""
        ll, n = self._ll, len(tokens)
        ll.llama_batch_ext_clear(self._batch)
        for i, tok in enumerate(tokens):
            idx = ll.llama_batch_ext_add_token(self._batch, 0, int(tok))
            if (idx < 0 or not self._set_pos(idx, (self._n_past + i, 0, 0, 0))
                    or not ll.llama_batch_ext_set_embd_token(self._batch, idx, self._embd(g[i]))):
                raise BackendError(f"cannot add pair {i} (token {tok}) to the decoder batch ({idx})")
            ll.llama_batch_ext_set_output_logits(self._batch, idx, outputs)
        try:
            self._process(DECODE, f"decode {n} pairs at position {self._n_past}")
        except BackendError:
            ll.llama_memory_seq_rm(self._mem, 0, self._n_past, -1)
            raise
        self._n_past += n
        if not outputs:
            return np.empty((0, self.n_vocab), np.float32), np.empty((0, self.n_embd), np.float32)
        return self._outputs(n)

    def decode_tree(self, tokens: Sequence[int], g: F32, positions: Sequence[int],
                    visible: npt.NDArray[np.bool_]) -> tuple[F32, F32]:
        """EAGLE-2's batched tree step (heads.eagle3_mlx.MlxEagle3Head.decode_tree's contract): pairs
        (tokens[i], g[i]) at positions[i], each attending to the entries `visible[i]` marks ((n, n_past + n):
        the entries held, then the n new ones), appended as entries n_past.. in row order. On libllama a
        row must see the whole context, then nothing or an earlier entry and what that entry saw, and sit
        one position past it (an EAGLE-2 node: its ancestors), and itself (heads.llama_head: tree entries).
        One llama_process, every row an output; `truncate` to at most the context drops the entries.

        Returns (logits (n, V) with −inf outside the draft vocabulary, pre-norm h (n, H)), every row.
        """
        ll, n = self._ll, len(tokens)
        g = np.ascontiguousarray(g, np.float32)
        if g.shape != (n, self.n_embd) or len(positions) != n:
            raise ValueError(f"decode_tree: {n} tokens need g ({n}, {self.n_embd}) and {n} positions "
                             f"(got {g.shape}, {len(positions)})")
        if not 0 < n <= self.n_batch:
            raise ValueError(f"decode_tree: {n} rows (1 to n_batch {self.n_batch})")
        ids = self._tree_rows(positions, visible)
        ll.llama_batch_ext_clear(self._batch)
        try:
            for i, (tok, s) in enumerate(zip(tokens, ids, strict=True)):
                idx = ll.llama_batch_ext_add_token(self._batch, s, int(tok))
                if (idx < 0 or not self._set_pos(idx, (int(positions[i]), 0, 0, 0))
                        or not ll.llama_batch_ext_set_embd_token(self._batch, idx, self._embd(g[i]))):
                    raise BackendError(f"cannot add tree row {i} (token {tok}) to the decoder batch ({idx})")
                ll.llama_batch_ext_set_output_logits(self._batch, idx, True)
            self._process(DECODE, f"tree step of {n} rows at positions {list(positions)}")
        except BackendError:
            self._tree_abort(ids)
            raise
        self._tree_commit(ids, positions, visible)
        return self._outputs(n)

    def _outputs(self, n: int) -> tuple[F32, F32]:
        """Logits (n, V) and pre-norm h (n, H) of the last pass's n rows (copied)."""
        h = np.stack([np.ctypeslib.as_array(self._api.get_nextn_ith(self._ctx, i), shape=(self.n_embd,))
                      for i in range(n)]).astype(np.float32)
        return self._logits(n), h

    def _no_tree(self, what: str) -> None:
        if self._entries:
            raise BackendError(f"{what} with tree entries held: truncate to the context first")
