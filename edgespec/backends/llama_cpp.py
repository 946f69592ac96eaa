"""llama.cpp backend on llama-cpp-python's low-level ctypes API (never the high-level `Llama`).

One model, one context, one sequence. Logits are requested only for the rows asked for; rollback
is `llama_memory_seq_rm`, its bool checked. llama.cpp's log goes to a ring buffer (shown with
verbose=True, and quoted in load errors).
"""

from __future__ import annotations

import collections
import ctypes
import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from edgespec.backends.base import LogitRows, VocabInfo
from edgespec.errors import BackendError, ContextOverflowError, MissingDependencyError, ModelLoadError

_LOG: collections.deque[str] = collections.deque(maxlen=200)
_state = {"verbose": False, "callback": None}


def _lib():
    try:
        import llama_cpp
    except ImportError as e:  # the optional extra is missing
        raise MissingDependencyError(
            "the llama.cpp backend needs llama-cpp-python: pip install 'edgespec[llama]'") from e
    if _state["callback"] is None:
        @llama_cpp.llama_log_callback
        def _log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            line = text.decode("utf-8", "replace")
            _LOG.append(line)
            if _state["verbose"]:
                os.write(2, text)

        _state["callback"] = _log  # keep a reference: C holds only the pointer
        llama_cpp.llama_log_set(_log, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
    return llama_cpp


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
_KV_TYPES = {"q8_0": 8, "f16": 1, "f32": 0}


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


def _diagnose(path: Path) -> str:
    """Why llama.cpp refused a GGUF file: a cut header or a tensor past the end of a truncated file
    (found by walking the header, ~0.1-0.4 s; gguf.GGUFReader parses every vocabulary entry and takes
    3-15 s); otherwise quote llama.cpp's last error line."""
    try:
        problem = _gguf_truncation(path)
    except (ValueError, KeyError, OSError) as e:  # struct.error is a ValueError
        problem = f"corrupt GGUF header ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    if problem:
        return problem
    errors = [ln.strip() for ln in _LOG if "error" in ln.lower() or "failed" in ln.lower()]
    return errors[-1] if errors else "llama.cpp could not load it (run with --verbose for its log)"


def _gguf_truncation(path: Path) -> str | None:
    """A one-line description if the GGUF file at `path` is cut short, else None. Reads only the
    header: metadata (skipped), tensor infos, alignment; compares tensor extents with the file size."""
    import mmap
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    _GGML_TYPES = {int(t) for t in GGML_QUANT_SIZES}
    size = path.stat().st_size
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        pos = 0

        def take(fmt: str) -> tuple:
            nonlocal pos
            n = struct.calcsize(fmt)
            if pos + n > size:
                raise EOFError
            pos += n
            return struct.unpack_from(fmt, mm, pos - n)

        def string() -> bytes:
            nonlocal pos
            (n,) = take("<Q")
            if pos + n > size:
                raise EOFError
            pos += n
            return mm[pos - n:pos]

        scalar = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

        def skip_value(vtype: int) -> None:
            nonlocal pos
            if vtype == 8:
                string()
            elif vtype == 9:
                sub, n = take("<IQ")
                if sub in scalar:
                    pos += n * scalar[sub]
                    if pos > size:
                        raise EOFError
                else:
                    for _ in range(n):
                        skip_value(sub)
            else:
                pos += scalar[vtype]

        try:
            _magic, _version, n_tensors, n_kv = take("<4sIQQ")
            alignment = 32
            for _ in range(n_kv):
                key = string()
                (vtype,) = take("<I")
                if key == b"general.alignment" and vtype == 4:
                    (alignment,) = take("<I")
                else:
                    skip_value(vtype)
            infos = []
            for _ in range(n_tensors):
                name = string().decode("utf-8", "replace")
                (n_dims,) = take("<I")
                dims = take(f"<{n_dims}Q")
                ggml_type, offset = take("<IQ")
                if ggml_type not in _GGML_TYPES:  # newer than the gguf package: size unknown
                    continue
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
                n_elems = 1
                for d in dims:
                    n_elems *= d
                infos.append((offset + n_elems // block * type_size, name))
        except EOFError:
            return f"truncated: the file ends inside its GGUF header ({size} bytes)"
        data_start = -(-pos // alignment) * alignment
        if not infos:
            return None
        cut = [(end, name) for end, name in infos if data_start + end > size]
        if cut:
            return (f"truncated: {size} bytes, but its tensors need {data_start + max(cut)[0]} "
                    f"(tensor {min(cut)[1]} is the first cut off)")
    return None


class _VocabCalls:
    """Tokenizer and metadata calls on a loaded llama.cpp model: shared by LlamaCppBackend and
    LlamaVocab (a vocab-only load, for backends that run the weights elsewhere)."""

    _ll: Any
    _model: Any

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


class LlamaCppBackend(_VocabCalls):
    """A GGUF model on llama.cpp.

    Args:
        path: GGUF file.
        n_ctx: context size in tokens.
        threads: CPU threads (default: up to 8).
        n_gpu_layers: layers to offload on CUDA/Metal builds (0 = CPU; -1 = all).
        n_batch: most tokens per llama_decode call (longer prompts are chunked).
        use_extra_bufts: llama.cpp's repacked CPU weight layouts. Off by default: with them, Q4_K
            batches give different logits than single tokens (MODELS.md), at no measured speed gain.
        kv_type: KV cache type: "auto" (Q8_0 where the model's head size allows, else F16), "q8_0",
            "f16" or "f32". With F16/F32 caches, llama.cpp's
            CPU flash attention takes a split-KV path for single-token steps once the cache passes
            256 cells, so they no longer match batched verification bit for bit; Q8_0 caches do,
            at the same measured speed and half the memory (README, known limits).
        verbose: print llama.cpp's log.
    """

    name = "llama.cpp"

    def __init__(self, path: str | os.PathLike, *, n_ctx: int = 4096, threads: int | None = None,
                 n_gpu_layers: int = 0, n_batch: int = 512, use_extra_bufts: bool = False,
                 kv_type: str = "auto", verbose: bool = False) -> None:
        self._model = self._ctx = self._batch = None  # before any raise: __del__ calls close()
        self._ll = ll = _lib()
        if kv_type not in (*_KV_TYPES, "auto"):
            raise BackendError(f"kv_type must be one of {', '.join(_KV_TYPES)} (got {kv_type!r})")
        _state["verbose"] = verbose
        p = Path(path).expanduser()
        check_gguf_file(p)
        self.path = str(p)
        mp = ll.llama_model_default_params()
        mp.n_gpu_layers = n_gpu_layers if n_gpu_layers >= 0 else 2**31 - 1
        mp.use_extra_bufts = use_extra_bufts
        _LOG.clear()
        self._model = ll.llama_model_load_from_file(self.path.encode(), mp)
        if not self._model:
            raise ModelLoadError(f"cannot load {p}: {_diagnose(p)}")
        threads = threads or default_threads()
        cp = ll.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_batch, n_batch
        cp.n_threads = cp.n_threads_batch = threads
        cp.n_seq_max = 1
        cp.swa_full = True  # sliding-window caches (Gemma 3) must keep what rollback may return to
        cp.no_perf = True
        self._configure_context(cp)
        for kv in ("q8_0", "f16") if kv_type == "auto" else (kv_type,):
            # Q8_0 needs head sizes divisible by its 32-value blocks; "auto" falls back to F16
            cp.type_k = cp.type_v = _KV_TYPES[kv]
            self._ctx = ll.llama_init_from_model(self._model, cp)
            if self._ctx:
                break
        self.kv_type = kv
        if not self._ctx:
            self.close()
            raise ModelLoadError(f"cannot create a llama.cpp context for {p} (n_ctx={n_ctx}, kv_type={kv_type}): "
                                 f"{_diagnose(p)}")
        self._init_vocab()
        self._mem = ll.llama_get_memory(self._ctx)
        self._batch = ll.llama_batch_init(n_batch, 0, 1)
        self.n_batch, self.threads = n_batch, threads
        self.n_ctx = ll.llama_n_ctx(self._ctx)
        self._n_past = 0

    def _configure_context(self, cp: Any) -> None:
        """Hook for subclasses: adjust llama_context_params after the model is loaded and before the
        context is created (llama_features.LlamaFeatureBackend sets cb_eval here)."""

    @property
    def n_past(self) -> int:
        return self._n_past

    # -- evaluation -------------------------------------------------------------------------------

    def eval(self, tokens: Sequence[int], rows: LogitRows = "last") -> npt.NDArray[np.float32]:
        n = len(tokens)
        if self._n_past + n > self.n_ctx:
            raise ContextOverflowError(
                f"{self._n_past} tokens in context + {n} new exceed the context of {self.n_ctx} tokens")
        out = []
        for start in range(0, n, self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            want = [rows == "all" or (rows == "last" and start + i == n - 1) for i in range(len(chunk))]
            self._decode(chunk, want)
            k = sum(want)
            if k:
                ptr = self._ll.llama_get_logits(self._ctx)  # rows for the outputs, in batch order
                out.append(np.ctypeslib.as_array(ptr, shape=(k, self.n_vocab)).copy())
        if not out:
            return np.empty((0, self.n_vocab), np.float32)
        return out[0] if len(out) == 1 else np.concatenate(out)

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
            # the cache may hold part of the batch: drop it so n_past stays the truth
            self._ll.llama_memory_seq_rm(self._mem, 0, self._n_past, -1)
            raise BackendError(f"llama_decode returned {rc} for {len(chunk)} tokens at position {self._n_past}")
        self._n_past += len(chunk)

    def truncate(self, n_past: int) -> None:
        if n_past >= self._n_past:
            return
        if not self._ll.llama_memory_seq_rm(self._mem, 0, n_past, -1):
            raise BackendError(f"llama_memory_seq_rm could not roll back from {self._n_past} to {n_past} tokens")
        self._n_past = n_past

    def close(self) -> None:
        ll = getattr(self, "_ll", None)
        if ll is None:
            return
        if self._batch is not None:
            ll.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            ll.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            ll.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        self.close()

    def __enter__(self) -> LlamaCppBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LlamaVocab(_VocabCalls):
    """A GGUF file's tokenizer and metadata alone: a vocab-only llama.cpp load (no weights, no
    context), for backends that run the weights elsewhere (MLX). Tokenization is then llama.cpp's,
    token for token."""

    def __init__(self, path: str | os.PathLike, verbose: bool = False) -> None:
        self._model = None
        self._ll = ll = _lib()
        _state["verbose"] = verbose
        p = Path(path).expanduser()
        check_gguf_file(p)
        mp = ll.llama_model_default_params()
        mp.vocab_only = True
        _LOG.clear()
        self._model = ll.llama_model_load_from_file(str(p).encode(), mp)
        if not self._model:
            raise ModelLoadError(f"cannot read the vocabulary of {p}: {_diagnose(p)}")
        self._init_vocab()

    def close(self) -> None:
        if self._model:
            self._ll.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        self.close()


def _tok_or_none(t: int) -> int | None:
    return None if t < 0 else int(t)
