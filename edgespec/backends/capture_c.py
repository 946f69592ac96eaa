"""The cb_eval feature capture as a compiled callback, for targets without libllama's layer-input API.

ggml calls the eval callback once per graph node (~940 per Gemma-3-270M decode) to ask whether the
node is wanted. From Python each call costs ~0.5 µs through ctypes: ~0.5 ms per 14 ms decode
(measured 3.7% with a callback that only returns False), paid by every step of a target that
serves a feature head, drafting or not. The same callback in C costs next to nothing.

edgespec compiles the fixed C source below with the system's C compiler (``$CC``, else ``cc``) the
first time it is needed, caches the library under ``$EDGESPEC_HOME/build/`` by a hash of the source,
and falls back to the Python callback (``llama_features._CbEvalCapture``) when there is no compiler
or the build fails. Nothing from a model file reaches the compiler. ``EDGESPEC_NO_CC=1`` forces the
fallback. The C callback copies exactly what the Python one does, so features agree bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from edgespec.errors import BackendError

MAX_SLOTS = 8
NAME_LEN = 64

C_SOURCE = r"""
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define MAX_SLOTS @MAX_SLOTS@
#define NAME_LEN @NAME_LEN@

/* ggml entry points, passed in as addresses: nothing to link against */
typedef const char * (*get_name_fn)(const void *);
typedef size_t (*nbytes_fn)(const void *);
typedef bool (*is_contiguous_fn)(const void *);
typedef void (*tensor_get_fn)(const void *, void *, size_t, size_t);

typedef struct {
    get_name_fn get_name;
    nbytes_fn nbytes;
    is_contiguous_fn is_contiguous;
    tensor_get_fn tensor_get;
    int32_t n;                       /* slots in use */
    char names[MAX_SLOTS][NAME_LEN];  /* node name per slot */
    void * dst[MAX_SLOTS];            /* destination buffer per slot */
    size_t cap[MAX_SLOTS];            /* its size in bytes */
    int64_t got[MAX_SLOTS];           /* bytes copied this decode; 0: none yet; -1: unusable tensor */
} capture_t;

/* ggml_backend_sched_eval_callback: ask = is this node wanted; !ask = it is computed, copy it */
bool edgespec_capture(void * t, bool ask, void * user_data) {
    capture_t * c = (capture_t *) user_data;
    const char * name = c->get_name(t);
    bool hit = false;
    for (int i = 0; i < c->n; i++) {
        if (strncmp(name, c->names[i], NAME_LEN) != 0) continue;
        hit = true;
        if (ask) break;
        size_t nb = c->nbytes(t);
        /* the first int32 of a ggml_tensor is its type: F32 = 0 */
        if (*(const int32_t *) t != 0 || !c->is_contiguous(t) || nb > c->cap[i]) {
            c->got[i] = -1;
            return false;  /* stops the graph: llama_decode fails and collect() reports it */
        }
        c->tensor_get(t, c->dst[i], 0, nb);
        c->got[i] = (int64_t) nb;
    }
    return ask ? hit : true;
}
""".replace("@MAX_SLOTS@", str(MAX_SLOTS)).replace("@NAME_LEN@", str(NAME_LEN))


class _Capture(ctypes.Structure):
    _fields_ = [("get_name", ctypes.c_void_p), ("nbytes", ctypes.c_void_p), ("is_contiguous", ctypes.c_void_p),
                ("tensor_get", ctypes.c_void_p), ("n", ctypes.c_int32),
                ("names", (ctypes.c_char * NAME_LEN) * MAX_SLOTS), ("dst", ctypes.c_void_p * MAX_SLOTS),
                ("cap", ctypes.c_size_t * MAX_SLOTS), ("got", ctypes.c_int64 * MAX_SLOTS)]


def find_compiler() -> str | None:
    """The C compiler the callback is built with: ``$CC``, else cc, gcc or clang on PATH (None: none)."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")


@functools.lru_cache(maxsize=1)
def compiled_callback() -> ctypes.CDLL | None:
    """The compiled library (built once, cached on disk), or None: no compiler, a failed build, or
    ``EDGESPEC_NO_CC`` set."""
    if os.environ.get("EDGESPEC_NO_CC"):
        return None
    from edgespec.models import edgespec_home

    digest = hashlib.sha256(C_SOURCE.encode()).hexdigest()[:16]
    lib_path = edgespec_home() / "build" / f"capture-{digest}.so"
    if not lib_path.exists():
        cc = find_compiler()
        if cc is None:
            return None
        try:
            lib_path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
                src, out = os.path.join(tmp, "capture.c"), os.path.join(tmp, "capture.so")
                with open(src, "w") as f:
                    f.write(C_SOURCE)
                subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", out, src], check=True,
                               capture_output=True, timeout=60)
                os.replace(out, lib_path)  # atomic: another process may be building the same file
        except (OSError, subprocess.SubprocessError):  # unwritable cache, compiler error or hang
            return None
    try:
        lib = ctypes.CDLL(str(lib_path))
        lib.edgespec_capture.restype = ctypes.c_bool
    except (OSError, AttributeError):
        return None
    return lib


class CCapture:
    """The compiled counterpart of ``llama_features._CbEvalCapture`` (same begin / forget / collect).

    Each slot gets a buffer for the largest decode (``n_batch`` rows); the callback copies the
    wanted tensors there and ``collect`` returns views of the rows written (valid until the next
    decode)."""

    def __init__(self, lib: ctypes.CDLL, ggml: ctypes.CDLL, names: Sequence[str], n_embd: int, n_batch: int) -> None:
        import llama_cpp

        if len(names) > MAX_SLOTS or any(len(n.encode()) >= NAME_LEN for n in names):
            raise ValueError(f"the compiled capture takes at most {MAX_SLOTS} names shorter than {NAME_LEN} bytes")
        self._n_embd = n_embd
        self._bufs = [np.empty((n_batch, n_embd), np.float32) for _ in names]
        c = self._c = _Capture()
        addr = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value  # noqa: E731
        c.get_name, c.nbytes = addr(ggml.ggml_get_name), addr(ggml.ggml_nbytes)
        c.is_contiguous, c.tensor_get = addr(ggml.ggml_is_contiguous), addr(ggml.ggml_backend_tensor_get)
        c.n = len(names)
        for i, (name, buf) in enumerate(zip(names, self._bufs)):
            c.names[i].value = name.encode()
            c.dst[i], c.cap[i] = buf.ctypes.data, buf.nbytes
        self.callback = ctypes.cast(lib.edgespec_capture, llama_cpp.ggml_backend_sched_eval_callback)
        self.user_data = ctypes.cast(ctypes.pointer(c), ctypes.c_void_p)

    def begin(self) -> None:
        for i in range(self._c.n):
            self._c.got[i] = 0

    def forget(self) -> bool:
        return False  # nothing memoized: a missing tensor is an error, not a stale memo

    def collect(self, n_tokens: int) -> list[npt.NDArray[np.float32]]:
        row = 4 * self._n_embd
        got = [self._c.got[i] for i in range(self._c.n)]
        missing = [i for i, b in enumerate(got) if b != n_tokens * row]
        if missing:
            raise BackendError(f"cb_eval captured no {n_tokens}-row F32 tensor for feature slot(s) {missing}")
        return [buf[:n_tokens] for buf in self._bufs]  # views: the caller concatenates them
