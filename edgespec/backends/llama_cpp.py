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
    """Why llama.cpp refused a GGUF file: the gguf reader names a tensor past the end of a truncated
    file; otherwise quote llama.cpp's last error line."""
    try:
        import gguf

        reader = gguf.GGUFReader(path)
        size = path.stat().st_size
        for t in reader.tensors:
            if int(t.data_offset) + int(t.n_bytes) > size:
                return f"truncated: tensor {t.name} ends past the end of the file ({size} bytes)"
    except (ValueError, IndexError, OSError, KeyError) as e:  # gguf raises these on damaged files
        return f"corrupt or truncated ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    errors = [ln.strip() for ln in _LOG if "error" in ln.lower() or "failed" in ln.lower()]
    return errors[-1] if errors else "llama.cpp could not load it (run with --verbose for its log)"


class LlamaCppBackend:
    """A GGUF model on llama.cpp.

    Args:
        path: GGUF file.
        n_ctx: context size in tokens.
        threads: CPU threads (default: up to 8).
        n_gpu_layers: layers to offload on CUDA/Metal builds (0 = CPU; -1 = all).
        n_batch: most tokens per llama_decode call (longer prompts are chunked).
        use_extra_bufts: llama.cpp's repacked CPU weight layouts. Off by default: with them, Q4_K
            batches give different logits than single tokens (MODELS.md), at no measured speed gain.
        verbose: print llama.cpp's log.
    """

    name = "llama.cpp"

    def __init__(self, path: str | os.PathLike, *, n_ctx: int = 4096, threads: int | None = None,
                 n_gpu_layers: int = 0, n_batch: int = 512, use_extra_bufts: bool = False,
                 verbose: bool = False) -> None:
        self._ll = ll = _lib()
        _state["verbose"] = verbose
        p = Path(path).expanduser()
        check_gguf_file(p)
        self.path = str(p)
        self._model = self._ctx = self._batch = None
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
        self._ctx = ll.llama_init_from_model(self._model, cp)
        if not self._ctx:
            self.close()
            raise ModelLoadError(f"cannot create a llama.cpp context for {p} (n_ctx={n_ctx}): {_diagnose(p)}")
        self._vocab = ll.llama_model_get_vocab(self._model)
        self._mem = ll.llama_get_memory(self._ctx)
        self._batch = ll.llama_batch_init(n_batch, 0, 1)
        self.n_batch, self.threads = n_batch, threads
        self.n_ctx = ll.llama_n_ctx(self._ctx)
        self.n_vocab = ll.llama_vocab_n_tokens(self._vocab)
        self.add_bos = bool(ll.llama_vocab_get_add_bos(self._vocab))
        self.bos_id = _tok_or_none(ll.llama_vocab_bos(self._vocab))
        self.eos_id = _tok_or_none(ll.llama_vocab_eos(self._vocab))
        self._n_past = 0
        self.token_to_bytes = lru_cache(maxsize=None)(self._piece)

    # -- tokens -----------------------------------------------------------------------------------

    @property
    def n_past(self) -> int:
        return self._n_past

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
        buf = ctypes.create_string_buffer(1 << 16)
        n = self._ll.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            self._ll.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

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


def _tok_or_none(t: int) -> int | None:
    return None if t < 0 else int(t)
