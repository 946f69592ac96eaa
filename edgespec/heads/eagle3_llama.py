"""An EAGLE-3 head GGUF run by libllama itself, the way llama.cpp's common/speculative.cpp drives it.

The head is loaded as a llama.cpp model (arch ``eagle3``) and gets its own context whose
``ctx_other`` is the target's context: a head without ``token_embd`` reads the target model's
token embeddings through it (llama.cpp refuses to create the context otherwise). Two passes:

* encode: ``llama_process(ENCODE)`` on rows of target features (3·H_t wide) → g rows, read back with
  ``llama_get_embeddings_nextn`` (the fc output; ext API, mangled name);
* decode: ``llama_process(DECODE)`` on (token, g) pairs at explicit positions → logits over the
  target vocabulary (−inf outside d2t) and the pre-norm hidden state
  (``llama_get_embeddings_nextn_ith``), which is the next g when drafting on.

Same interface as the numpy ``Eagle3Head`` (encode / decode / truncate / n_past), so the two can be
compared on the same inputs.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from edgespec.backends.llama_cpp import _KV_TYPES, LlamaCppBackend, _diagnose, _lib, check_gguf_file
from edgespec.backends.llama_features import ext_api
from edgespec.errors import BackendError, ModelLoadError

F32 = npt.NDArray[np.float32]
_ENCODE, _DECODE = 0, 1  # enum llama_process_type


class LlamaEagle3Head:
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
        self._model = self._ctx = self._batch = None
        self._ll = ll = _lib()
        api = ext_api()
        if api is None:
            raise BackendError("this libllama does not export the ext API an EAGLE-3 head needs")
        self._api = api
        p = Path(path).expanduser()
        check_gguf_file(p)
        self._model = ll.llama_model_load_from_file(str(p).encode(), ll.llama_model_default_params())
        if not self._model:
            raise ModelLoadError(f"cannot load {p}: {_diagnose(p)}")
        self.target_layers = api.model_target_layers(self._model)
        if len(self.target_layers) != 3:
            raise ModelLoadError(f"{p} is not an EAGLE-3 head (target layers {self.target_layers})")
        self.n_embd = ll.llama_model_n_embd(self._model)
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self._model))
        self.n_embd_tgt = ll.llama_model_n_embd(target._model)
        cp = ll.llama_context_default_params()
        cp.n_ctx = target.n_ctx
        cp.n_batch = cp.n_ubatch = target.n_batch  # the encoder needs a whole batch in one ubatch
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = threads or target.threads
        cp.type_k = cp.type_v = _KV_TYPES[kv_type]
        cp.flash_attn_type = -1 if flash_attn else 0  # AUTO / DISABLED
        cp.no_perf = True
        cp.ctx_other = target._ctx
        self._ctx = ll.llama_init_from_model(self._model, cp)
        if not self._ctx:
            self.close()
            raise ModelLoadError(f"cannot create a llama.cpp context for the head {p}: {_diagnose(p)}")
        api.set_nextn(self._ctx, True, True)  # pre-norm rows for the outputs asked for
        self._mem = ll.llama_get_memory(self._ctx)
        self._batch = ll.llama_batch_ext_init(self._ctx)
        self.n_batch = target.n_batch
        self._target = target  # keeps ctx_other alive as long as this head
        self._n_past = 0

    @property
    def n_past(self) -> int:
        """Positions in the head's KV cache."""
        return self._n_past

    def _embd(self, row: F32) -> Any:
        return self._ll.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, row.shape[0])

    def _process(self, kind: int, what: str) -> None:
        rc = self._ll.llama_process(self._ctx, kind, self._batch)
        if rc != 0:
            raise BackendError(f"llama_process({what}) returned {rc}")

    def encode(self, features: F32) -> F32:
        """fc over target features: (n, 3·H_t) → g (n, H)."""
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
                # head's KV cache (Y = X + 1), as common/speculative.cpp's placeholders do
                pos = (ll.llama_pos * 4)(self._n_past + start + i, 0, 0, 0)
                if idx < 0 or not ll.llama_batch_ext_set_pos(self._batch, idx, pos):
                    raise BackendError(f"cannot add feature row {start + i} to the encoder batch ({idx})")
                ll.llama_batch_ext_set_output_embd(self._batch, idx, True)
            self._process(_ENCODE, f"encode {len(chunk)} rows")
            ptr = self._api.get_nextn(self._ctx)
            out.append(np.ctypeslib.as_array(ptr, shape=(len(chunk), self.n_embd)).copy())
        return np.concatenate(out) if out else np.empty((0, self.n_embd), np.float32)

    def decode(self, tokens: Sequence[int], g: F32, rows: Literal["all", "last"] = "all") -> tuple[F32, F32]:
        """The decoder on pairs (tokens[i], g[i]) at positions n_past+i (appended to the head's KV).

        Args:
            rows: outputs for every pair, or only the last (the LM head dominates the cost: measured
                on SmolLM2 with V_d 8192, 1.5 ms for one pair, 4.4 ms for three with all outputs).

        Returns:
            (logits (k, V) with −inf outside the draft vocabulary, pre-norm h (k, H)); k = n or 1.
        """
        g = np.ascontiguousarray(g, np.float32)
        n = len(tokens)
        if g.shape != (n, self.n_embd):
            raise ValueError(f"g must be ({n}, {self.n_embd}) for {n} tokens (got {g.shape})")
        if n > self.n_batch:
            raise ValueError(f"at most {self.n_batch} pairs per decode (got {n})")
        if rows == "last" and n > 1:
            # 0.3.36's eagle3 graph selects no output rows: a batch whose only output is its last pair
            # gets the FIRST pair's logits and h (measured). Like common/speculative.cpp, run the
            # pairs before it without outputs, then the last alone.
            self._run(tokens[:-1], g[:-1], outputs=False)
            return self._run(tokens[-1:], g[-1:], outputs=True)
        return self._run(tokens, g, outputs=True)

    def _run(self, tokens: Sequence[int], g: F32, outputs: bool) -> tuple[F32, F32]:
        """One llama_process(DECODE) of the pairs, with outputs for all of them or none."""
        ll, n = self._ll, len(tokens)
        ll.llama_batch_ext_clear(self._batch)
        for i, tok in enumerate(tokens):
            idx = ll.llama_batch_ext_add_token(self._batch, 0, int(tok))
            pos = (ll.llama_pos * 4)(self._n_past + i, 0, 0, 0)
            if (idx < 0 or not ll.llama_batch_ext_set_pos(self._batch, idx, pos)
                    or not ll.llama_batch_ext_set_embd_token(self._batch, idx, self._embd(g[i]))):
                raise BackendError(f"cannot add pair {i} (token {tok}) to the decoder batch ({idx})")
            ll.llama_batch_ext_set_output_logits(self._batch, idx, outputs)
        try:
            self._process(_DECODE, f"decode {n} pairs at position {self._n_past}")
        except BackendError:
            ll.llama_memory_seq_rm(self._mem, 0, self._n_past, -1)
            raise
        self._n_past += n
        if not outputs:
            return np.empty((0, self.n_vocab), np.float32), np.empty((0, self.n_embd), np.float32)
        logits = np.stack([np.ctypeslib.as_array(ll.llama_get_logits_ith(self._ctx, i), shape=(self.n_vocab,))
                           for i in range(n)]).astype(np.float32)
        h = np.stack([np.ctypeslib.as_array(self._api.get_nextn_ith(self._ctx, i), shape=(self.n_embd,))
                      for i in range(n)]).astype(np.float32)
        return logits, h

    def truncate(self, n_past: int) -> None:
        """Drop the head's KV entries of positions ≥ n_past."""
        if n_past >= self._n_past:
            return
        if not self._ll.llama_memory_seq_rm(self._mem, 0, n_past, -1):
            raise BackendError(f"llama_memory_seq_rm could not roll the head back to {n_past}")
        self._n_past = n_past

    def close(self) -> None:
        ll = getattr(self, "_ll", None)
        if ll is None:
            return
        if self._batch:
            ll.llama_batch_ext_free(self._batch)
            self._batch = None
        if self._ctx:
            ll.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            ll.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        self.close()

    def __enter__(self) -> LlamaEagle3Head:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
