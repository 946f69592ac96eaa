"""What the libllama-run feature heads (EAGLE-3, DFlash) share: a head GGUF loaded as a llama.cpp
model, its own context (``ctx_other`` = the target's context when there is a target, so a head
without token embeddings or LM head reads the target model's), one ext batch reused per call, and
a KV cache of ``n_past`` positions on sequence 0 that ``truncate`` rolls back.
"""

from __future__ import annotations

import ctypes
import os
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

    ``close()`` frees the head's model, context and batch (LlamaHandles).
    """

    def __init__(self, path: str | os.PathLike, target: LlamaCppBackend | None, *, kind: str,
                 n_ctx: int | None = None, n_batch: int | None = None, kv_type: str = "f16",
                 flash_attn: bool = True, threads: int | None = None) -> None:
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
        cp.n_seq_max = 1
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
        self._n_past = 0

    @property
    def n_past(self) -> int:
        """Positions in the head's KV cache."""
        return self._n_past

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
        """Drop the head's KV entries of positions ≥ n_past."""
        if n_past >= self._n_past:
            return
        self._seq_rm(n_past)
        self._n_past = n_past
