"""llama.cpp backend on llama-cpp-python's low-level ctypes API (never the high-level `Llama`).

One model, one context, one sequence. Logits are requested only for the rows asked for; rollback
is `llama_memory_seq_rm`, its bool checked; a recurrent or hybrid model (Mamba-2, LFM2) rolls its
recurrent layers back to a checkpoint of their state instead (`checkpoint`, `truncate`). llama.cpp's
log goes to a ring buffer (echoed while a verbose=True backend is open, and quoted in load errors:
backends/deps.py).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from edgespec.backends.base import Closing, LogitRows, StateCheckpoint, VocabInfo, check_room, join_rows
from edgespec.backends.deps import clear_llama_log, hide_llama_log, import_llama, llama_log, show_llama_log
from edgespec.errors import BackendError, ModelLoadError


def model_metadata(ll: Any, model: Any, key: str) -> str | None:
    """A llama.cpp model's metadata value as text (llama_model_meta_val_str), None if absent."""
    buf = ctypes.create_string_buffer(1 << 16)
    n = ll.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    if n < 0:
        return None
    if n >= len(buf):
        buf = ctypes.create_string_buffer(n + 1)
        ll.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace")


# ggml type ids (ggml.h) for the KV cache
KV_TYPES = {"q8_0": 8, "f16": 1, "f32": 0}


def default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def check_gguf_file(path: Path) -> None:
    """One-line ModelLoadError for a missing, unreadable or non-GGUF file."""
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelLoadError(f"not a file: {path}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")


def load_failure_reason(path: Path) -> str:
    """Why llama.cpp refused a GGUF file: what its header says (a cut header, a tensor past the end of
    a truncated file: ``gguf_file.gguf_problem``), otherwise llama.cpp's last error line."""
    from edgespec.gguf_file import gguf_problem

    problem = gguf_problem(path)
    if problem:
        return problem
    errors = [ln.strip() for ln in llama_log() if "error" in ln.lower() or "failed" in ln.lower()]
    return errors[-1] if errors else "llama.cpp could not load it (run with --verbose for its log)"


class LlamaHandles(Closing):
    """The libllama handles one object owns (a model, its context, a batch), freed once in reverse
    order by close(), at garbage collection or at the end of a ``with`` block. The owners:
    LlamaCppBackend, LlamaVocab (a model alone), heads.llama_head.LlamaHeadContext (an ext batch).

    Args:
        verbose: echo llama.cpp's log to stderr while this object is open (deps.show_llama_log).
    """

    def __init__(self, verbose: bool = False) -> None:
        self._model: Any = None  # before any raise: close() runs on half-built objects too
        self._ctx: Any = None
        self._batch: Any = None
        self._free_batch: Any = None  # llama_batch_free or llama_batch_ext_free, by the batch's kind
        self._ll = import_llama()
        if verbose:
            show_llama_log(self)

    @property
    def llama_model(self) -> Any:
        """The llama_model pointer, for libllama calls on this model (None once closed)."""
        return self._model

    @property
    def llama_context(self) -> Any:
        """The llama_context pointer (a head's ``ctx_other``; None once closed or when there is none)."""
        return self._ctx

    def _load_model(self, path: Path, params: Any, what: str) -> None:
        """llama_model_load_from_file, or a one-line ModelLoadError saying why not (`what` failed)."""
        clear_llama_log()
        self._model = self._ll.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            raise ModelLoadError(f"cannot {what} {path}: {load_failure_reason(path)}")

    def close(self) -> None:
        ll = self.__dict__.get("_ll")
        if ll is None:  # import_llama raised: nothing was created
            return
        hide_llama_log(self)
        if self._batch and self._free_batch is not None:  # a batch struct, or a non-NULL ext batch pointer
            self._free_batch(self._batch)
        self._batch = None
        if self._ctx:
            ll.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            ll.llama_model_free(self._model)
            self._model = None


class _VocabCalls(LlamaHandles):
    """Tokenizer and metadata calls on a loaded llama.cpp model: shared by LlamaCppBackend and
    LlamaVocab (a vocab-only load, for backends that run the weights elsewhere)."""

    def _init_vocab(self) -> None:
        ll = self._ll
        self._vocab = ll.llama_model_get_vocab(self._model)
        self.n_vocab = ll.llama_vocab_n_tokens(self._vocab)
        self.add_bos = bool(ll.llama_vocab_get_add_bos(self._vocab))
        self.bos_id = _tok_or_none(ll.llama_vocab_bos(self._vocab))
        self.eos_id = _tok_or_none(ll.llama_vocab_eos(self._vocab))
        self.token_to_bytes = lru_cache(maxsize=None)(self._piece)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (self._ll.llama_token * n_max)()
        n = self._ll.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            buf = (self._ll.llama_token * n_max)()
            n = self._ll.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            raise BackendError(f"llama_tokenize failed ({n}) on a text of {len(data)} bytes")
        return list(buf[:n])

    def _piece(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = self._ll.llama_token_to_piece(self._vocab, token, buf, 64, 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self._ll.llama_token_to_piece(self._vocab, token, buf, -n, 0, False)
        return buf.raw[:n]

    def is_eog(self, token: int) -> bool:
        return bool(self._ll.llama_vocab_is_eog(self._vocab, token))

    def vocab_fingerprint(self) -> VocabInfo:
        ll, v = self._ll, self._vocab
        return VocabInfo(
            vocab_type=ll.llama_vocab_type(v), n_vocab=self.n_vocab,
            add_bos=self.add_bos, bos_id=self.bos_id,
            add_eos=bool(ll.llama_vocab_get_add_eos(v)), eos_id=self.eos_id,
            token_text=lambda i: ll.llama_vocab_get_text(v, i).decode("utf-8", "replace"))

    def metadata(self, key: str) -> str | None:
        return model_metadata(self._ll, self._model, key)


class _LogitRows:
    """Numpy views of llama.cpp's logits buffer (valid until the next decode), kept per (address,
    rows): after a forward, the Python that builds a new view runs from cold caches (np.ctypeslib
    .as_array is far dearer than reusing a kept view). llama_get_logits is asked
    every time, so a buffer llama.cpp reallocated is never read through a stale view."""

    def __init__(self, ll: Any, ctx: Any, n_vocab: int) -> None:
        self._get = ll.llama_cpp._lib["llama_get_logits"]  # a function object of our own: restype an int
        self._get.argtypes, self._get.restype = [ctypes.c_void_p], ctypes.c_void_p
        self._ctx, self._n_vocab, self._views = ctx, n_vocab, {}

    def __call__(self, k: int) -> npt.NDArray[np.float32]:
        """The k output rows of the last decode, (k, n_vocab), in place."""
        key = (self._get(self._ctx), k)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 64:
                self._views.clear()
            buf = (ctypes.c_float * (k * self._n_vocab)).from_address(key[0])
            view = self._views[key] = np.frombuffer(buf, np.float32).reshape(k, self._n_vocab)
        return view


class LlamaCppBackend(_VocabCalls):
    """A GGUF model on llama.cpp.

    Args:
        path: GGUF file.
        n_ctx: context size in tokens.
        threads: CPU threads (default: up to 8).
        n_gpu_layers: layers to offload on CUDA/Metal builds (0 = CPU; -1 = all).
        n_batch: most tokens per llama_decode call (longer prompts are chunked).
        use_extra_bufts: llama.cpp's repacked CPU weight layouts. Off by default: with them, Q4_K
            batches give different logits than single tokens, at no speed gain here.
        kv_type: KV cache type: "auto" (Q8_0 where the model's head size allows, else F16), "q8_0",
            "f16" or "f32". With F16/F32 caches, llama.cpp's
            CPU flash attention takes a split-KV path for single-token steps once the cache passes
            256 cells, so they no longer match batched verification bit for bit; Q8_0 caches do,
            at the same measured speed and half the memory (docs/known-limits.md).
        verbose: print llama.cpp's log while this backend is open (deps.show_llama_log).
        tree_leaves: most leaves of a draft tree (llama_tree.eval_tree); > 0: unified KV, 1 + that many seqs.

    ``recurrent`` is True for recurrent and hybrid models (llama_model_is_recurrent / _is_hybrid):
    ``checkpoint`` then saves the recurrent layers' state (llama_state_seq_get_data_ext with
    LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: the recurrent cells alone, not a hybrid's attention KV), and
    ``truncate`` restores it, cuts the attention KV back and re-evaluates up to the new length.
    """

    name = "llama.cpp"
    recurrent = False

    def __init__(self, path: str | os.PathLike, *, n_ctx: int = 4096, threads: int | None = None,
                 n_gpu_layers: int = 0, n_batch: int = 512, use_extra_bufts: bool = False,
                 kv_type: str = "auto", verbose: bool = False, tree_leaves: int = 0) -> None:
        if kv_type not in (*KV_TYPES, "auto"):
            raise BackendError(f"kv_type must be one of {', '.join(KV_TYPES)} (got {kv_type!r})")
        super().__init__(verbose)
        ll = self._ll
        p = Path(path).expanduser()
        check_gguf_file(p)
        self.path = str(p)
        mp = ll.llama_model_default_params()
        mp.n_gpu_layers = n_gpu_layers if n_gpu_layers >= 0 else 2**31 - 1
        mp.use_extra_bufts = use_extra_bufts
        self._load_model(p, mp, "load")
        self.recurrent = bool(ll.llama_model_is_recurrent(self._model) or ll.llama_model_is_hybrid(self._model))
        threads = threads or default_threads()
        cp = ll.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_batch, n_batch
        cp.n_threads = cp.n_threads_batch = threads
        cp.n_seq_max, cp.kv_unified, self.tree_leaves = 1 + tree_leaves, tree_leaves > 0, tree_leaves  # llama_tree
        cp.swa_full = True  # sliding-window caches (Gemma 3) must keep what rollback may return to
        cp.no_perf = True
        self._configure_context(cp)
        for kv in ("q8_0", "f16") if kv_type == "auto" else (kv_type,):
            # Q8_0 needs head sizes divisible by its 32-value blocks; "auto" falls back to F16
            cp.type_k = cp.type_v = KV_TYPES[kv]
            self._ctx = ll.llama_init_from_model(self._model, cp)
            if self._ctx:
                break
        self.kv_type = kv
        if not self._ctx:
            self.close()
            raise ModelLoadError(f"cannot create a llama.cpp context for {p} (n_ctx={n_ctx}, kv_type={kv_type}): "
                                 f"{load_failure_reason(p)}")
        self._init_vocab()
        self._mem = ll.llama_get_memory(self._ctx)
        self._logit_rows = _LogitRows(ll, self._ctx, self.n_vocab)
        self._batch, self._free_batch = ll.llama_batch_init(n_batch, 0, 1), ll.llama_batch_free
        self.n_batch, self.threads = n_batch, threads
        self.n_ctx = ll.llama_n_ctx(self._ctx)
        self._n_past = 0
        self._ckpt = StateCheckpoint()  # state: bytes of self._state_buf in use
        self._state_buf = np.empty(0, np.uint8)  # reused: a checkpoint's size is fixed once n_past > 0
        self._state_ptr: Any = None

    def _configure_context(self, cp: Any) -> None:
        """Hook for subclasses: adjust llama_context_params after the model is loaded and before the
        context is created (llama_features.LlamaFeatureBackend sets cb_eval here)."""

    @property
    def n_past(self) -> int:
        return self._n_past

    # -- evaluation -------------------------------------------------------------------------------

    def eval(self, tokens: Sequence[int], rows: LogitRows = "last") -> npt.NDArray[np.float32]:
        n = len(tokens)
        check_room(self._n_past, n, self.n_ctx)
        out = []
        for start in range(0, n, self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            want = [rows == "all" or (rows == "last" and start + i == n - 1) for i in range(len(chunk))]
            self._decode(chunk, want)
            k = sum(want)
            if k:
                out.append(self._logit_rows(k).copy())  # rows for the outputs, in batch order
        return join_rows(out, self.n_vocab)

    def eval_argmax(self, tokens: Sequence[int]) -> npt.NDArray[np.int64]:
        n = len(tokens)
        check_room(self._n_past, n, self.n_ctx)
        out = np.empty(n, np.int64)
        for start in range(0, n, self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            self._decode(chunk, [True] * len(chunk))
            # read in llama.cpp's own output buffer: no copy of the rows. llama.cpp's greedy backend
            # sampler (argmax in the graph) made each forward slower on CPU, so it is not used
            # (docs/experiments/host-path.md)
            out[start:start + len(chunk)] = self._logit_rows(len(chunk)).argmax(axis=1)
        return out

    def _decode(self, chunk: Sequence[int], want: list[bool]) -> None:
        b = self._batch
        b.n_tokens = len(chunk)
        for i, tok in enumerate(chunk):
            b.token[i] = tok
            b.pos[i] = self._n_past + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = want[i]
        rc = self._ll.llama_decode(self._ctx, b)
        if rc != 0:
            msg = f"llama_decode returned {rc} for {len(chunk)} tokens at position {self._n_past}"
            if self.recurrent:  # a recurrent state cannot drop part of a batch: start over
                self._drop_all()
                raise BackendError(f"{msg} (the recurrent state was reset to 0 tokens)")
            # the cache may hold part of the batch: drop it so n_past stays the truth
            self._ll.llama_memory_seq_rm(self._mem, 0, self._n_past, -1)
            raise BackendError(msg)
        self._n_past += len(chunk)
        if self.recurrent:
            self._ckpt.evaluated(chunk)

    def checkpoint(self) -> None:
        """Save the recurrent layers' state at n_past (nothing to do when recurrent is False: the KV
        cache rolls back to any position)."""
        if not self.recurrent:
            return
        ll, flags = self._ll, self._ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        size = ll.llama_state_seq_get_size_ext(self._ctx, 0, flags)
        if size > len(self._state_buf):
            self._state_buf = np.empty(size, np.uint8)
            self._state_ptr = self._state_buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        n = ll.llama_state_seq_get_data_ext(self._ctx, self._state_ptr, size, 0, flags)
        if n == 0:
            raise BackendError(f"llama_state_seq_get_data_ext could not save the recurrent state at {self._n_past} "
                               f"tokens ({size} bytes)")
        self._ckpt.take(n, self._n_past)

    @property
    def checkpoint_at(self) -> int | None:
        return self._ckpt.position

    def truncate(self, n_past: int) -> None:
        if n_past >= self._n_past:
            return
        if self.recurrent:
            self._roll_back(n_past)
            return
        if not self._ll.llama_memory_seq_rm(self._mem, 0, n_past, -1):
            raise BackendError(f"llama_memory_seq_rm could not roll back from {self._n_past} to {n_past} tokens")
        self._n_past = n_past

    def _roll_back(self, n: int) -> None:
        """Restore the checkpoint (at c <= n), cut the attention KV to c, re-evaluate tokens c..n."""
        if n == 0:
            self._drop_all()
            return
        replay = self._ckpt.replay(self._n_past, n)  # BackendError without a checkpoint at or before n
        c, size, ll = self._ckpt.at, self._ckpt.state, self._ll
        # restoring puts the recurrent cell back at position c-1, so that seq_rm(c, -1) then only
        # cuts the attention KV; before it, seq_rm would refuse (a recurrent cell at >= c)
        if ll.llama_state_seq_set_data_ext(self._ctx, self._state_ptr, size, 0,
                                           ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) != size:
            self._drop_all()
            raise BackendError(f"llama_state_seq_set_data_ext could not restore the recurrent state saved at {c} "
                               f"tokens (reset to 0 tokens)")
        if not ll.llama_memory_seq_rm(self._mem, 0, c, -1):
            self._drop_all()
            raise BackendError(f"llama_memory_seq_rm could not cut the restored state back to {c} tokens "
                               f"(reset to 0 tokens)")
        self._n_past = c
        if replay:  # eval records them again: the checkpoint stays usable
            self.eval(replay, rows="none")

    def _drop_all(self) -> None:
        if not self._ll.llama_memory_seq_rm(self._mem, 0, -1, -1):
            raise BackendError(f"llama_memory_seq_rm could not clear the state of {self._n_past} tokens")
        self._n_past = 0
        self._ckpt.clear()


class LlamaVocab(_VocabCalls):
    """A GGUF file's tokenizer and metadata alone: a vocab-only llama.cpp load (no weights, no
    context), for backends that run the weights elsewhere (MLX). Tokenization is then llama.cpp's,
    token for token."""

    def __init__(self, path: str | os.PathLike, verbose: bool = False) -> None:
        super().__init__(verbose)
        p = Path(path).expanduser()
        check_gguf_file(p)
        mp = self._ll.llama_model_default_params()
        mp.vocab_only = True
        self._load_model(p, mp, "read the vocabulary of")
        self._init_vocab()


def _tok_or_none(t: int) -> int | None:
    return None if t < 0 else int(t)
