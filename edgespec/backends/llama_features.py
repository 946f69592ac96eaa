"""Target features for feature heads (EAGLE-3) from the llama.cpp backend, in the same forward pass.

A feature of target layer id L at position p is the INPUT of transformer layer L for the token at p,
i.e. the output of layer L-1 (the residual stream). That is what llama.cpp's
``llama_get_embeddings_layer_inp(ctx, L)`` returns and what its EAGLE-3 driver feeds the head
(common/speculative.cpp), and what the EAGLE-3 reference code collects (the hidden state *before*
layer L). EAGLE-3's default ids are ``(2, n_layer // 2, n_layer - 3)`` (vendored
conversion/llama.py, when a head's config names no ``eagle_aux_hidden_state_layer_ids``):
SmolLM2-135M (30 layers) → (2, 15, 27), Gemma-3-270M (18 layers) → (2, 9, 15).

Two ways to get them, chosen per model:

* ``"ext"``: libllama's staging API (src/llama-ext.h), exported only under C++-mangled names and
  bound here by those names. Used only for architectures whose graph sets ``t_layer_inp``
  (``EXT_ARCHS``): for others (gemma3) enabling it makes the next decode abort the process
  (GGML_ASSERT "layer input tensor is null"), which Python cannot catch.
* ``"cb_eval"``: a ggml scheduler eval callback that copies the tensors named ``l_out-<L-1>`` as
  they are computed. Works for any llama.cpp graph that names its layer outputs ``l_out``. ggml
  calls it for every graph node (~940 per Gemma-3-270M decode), so it is installed only on
  contexts that ask for features, and it is compiled C where a C compiler is found
  (``capture_c``); the Python fallback remembers which node addresses it wants instead of
  reading every node's name each decode (see ``_CbEvalCapture``).

Both read the same computed tensor, so they agree bit for bit (tested on SmolLM2).
Valid ids are 1..n_layer-1: id 0 would be the (arch-specific) input embedding, and the last
layer's output holds only the rows whose logits were requested.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from edgespec.backends.capture_c import CCapture, compiled_callback
from edgespec.backends.llama_cpp import LlamaCppBackend
from edgespec.errors import BackendError

FeatureMethod = Literal["auto", "ext", "cb_eval"]

# Mangled names of src/llama-ext.h's functions in libllama 0.3.36 (Itanium ABI; `nm -D libllama.so`).
EXT_SYMBOLS: dict[str, str] = {
    "set_layer_inp": "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
    "get_layer_inp": "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
    "set_nextn": "_Z26llama_set_embeddings_nextnP13llama_contextbb",
    "get_nextn": "_Z26llama_get_embeddings_nextnP13llama_context",
    "get_nextn_ith": "_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
    "target_layer_ids": "_Z28llama_model_target_layer_idsPK11llama_model",
    "target_layer_ids_n": "_Z30llama_model_target_layer_ids_nPK11llama_model",
    "get_tok_embd": "_Z24llama_model_get_tok_embdPK11llama_modelPf",
}

# Architectures whose 0.3.36 graph sets t_layer_inp for every layer (src/models/llama.cpp, qwen3.cpp,
# qwen3moe.cpp). Only "llama" is exercised by the tests; every other arch takes the cb_eval path.
EXT_ARCHS = frozenset({"llama", "qwen3", "qwen3moe"})


def eagle3_layer_ids(n_layer: int) -> tuple[int, int, int]:
    """EAGLE-3's default target layer ids for an ``n_layer``-layer target: (2, n//2, n-3).

    Raises:
        ValueError: if the target is too shallow for three ids in 1..n_layer-1 (n_layer < 5).
    """
    ids = (2, n_layer // 2, n_layer - 3)
    if n_layer < 5:
        raise ValueError(f"EAGLE-3's default layers {ids} need a target of at least 5 layers (got {n_layer})")
    return ids


class ExtApi:
    """ctypes bindings of the llama-ext.h functions edgespec uses, by their mangled names."""

    set_layer_inp: Any  # (ctx, lid, on) -> None
    get_layer_inp: Any  # (ctx, lid) -> float* of n_batch × n_embd (rows of the last decode first)
    set_nextn: Any  # (ctx, on, masked) -> None
    get_nextn: Any  # (ctx) -> float*
    get_nextn_ith: Any  # (ctx, i) -> float*
    target_layer_ids: Any  # (model) -> int32*
    target_layer_ids_n: Any  # (model) -> uint32
    get_tok_embd: Any  # (model, float* or NULL) -> number of floats

    def __init__(self, lib: ctypes.CDLL) -> None:
        import llama_cpp

        ctx_p, model_p, f32_p = (llama_cpp.llama_context_p_ctypes, llama_cpp.llama_model_p_ctypes,
                                 ctypes.POINTER(ctypes.c_float))
        sig: dict[str, tuple[list[Any], Any]] = {
            "set_layer_inp": ([ctx_p, ctypes.c_uint32, ctypes.c_bool], None),
            "get_layer_inp": ([ctx_p, ctypes.c_uint32], f32_p),
            "set_nextn": ([ctx_p, ctypes.c_bool, ctypes.c_bool], None),
            "get_nextn": ([ctx_p], f32_p),
            "get_nextn_ith": ([ctx_p, ctypes.c_int32], f32_p),
            "target_layer_ids": ([model_p], ctypes.POINTER(ctypes.c_int32)),
            "target_layer_ids_n": ([model_p], ctypes.c_uint32),
            "get_tok_embd": ([model_p, f32_p], ctypes.c_uint32),
        }
        for key, (argtypes, restype) in sig.items():
            fn = getattr(lib, EXT_SYMBOLS[key])  # AttributeError if absent: caught by ext_api()
            fn.argtypes, fn.restype = argtypes, restype
            setattr(self, key, fn)

    def model_target_layers(self, model: Any) -> tuple[int, ...]:
        """The target layer ids an EAGLE-3/DFlash head model carries (``eagle3.target_layers``)."""
        n = self.target_layer_ids_n(model)
        ptr = self.target_layer_ids(model)
        return tuple(int(ptr[i]) for i in range(n)) if n and ptr else ()


@functools.lru_cache(maxsize=1)
def ext_api() -> ExtApi | None:
    """The ext bindings, or None when this libllama does not export them (another version/ABI)."""
    import llama_cpp

    try:
        return ExtApi(llama_cpp.llama_cpp._lib)
    except AttributeError:
        return None


@functools.lru_cache(maxsize=1)
def _ggml() -> ctypes.CDLL:
    """libggml-base (ggml_get_name, ggml_backend_tensor_get, ...), loaded from llama_cpp's lib dir."""
    import llama_cpp
    from llama_cpp._ctypes_extensions import load_shared_library

    lib = load_shared_library("ggml-base", llama_cpp.llama_cpp._base_path)
    lib.ggml_get_name.argtypes, lib.ggml_get_name.restype = [ctypes.c_void_p], ctypes.c_char_p
    lib.ggml_nbytes.argtypes, lib.ggml_nbytes.restype = [ctypes.c_void_p], ctypes.c_size_t
    lib.ggml_nrows.argtypes, lib.ggml_nrows.restype = [ctypes.c_void_p], ctypes.c_int64
    lib.ggml_is_contiguous.argtypes, lib.ggml_is_contiguous.restype = [ctypes.c_void_p], ctypes.c_bool
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.ggml_backend_tensor_get.restype = None
    return lib


class FeatureStore:
    """Rows of features indexed by KV position: row p belongs to the token at position p."""

    def __init__(self, width: int) -> None:
        self.width = width
        self._buf = np.empty((0, width), np.float32)
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def append(self, rows: npt.NDArray[np.float32]) -> None:
        need = self._n + len(rows)
        if need > len(self._buf):
            grown = np.empty((max(need, 2 * len(self._buf), 64), self.width), np.float32)
            grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        self._buf[self._n:need] = rows
        self._n = need

    def truncate(self, n: int) -> None:
        self._n = min(self._n, n)

    def rows(self, start: int, stop: int) -> npt.NDArray[np.float32]:
        if not 0 <= start <= stop <= self._n:
            raise IndexError(f"feature rows [{start}, {stop}) outside the {self._n} stored")
        return self._buf[start:stop].copy()


class StoredFeatures:
    """``features`` and a ``truncate`` that keeps them in step with the KV cache, for a backend
    that appends one row per evaluated position to ``self._store`` (a FeatureStore):
    LlamaFeatureBackend and mlx_features.MlxFeatureBackend. List it before the backend class."""

    _store: FeatureStore
    n_past: int

    def truncate(self, n_past: int) -> None:
        super().truncate(n_past)  # type: ignore[misc]  # the backend's rollback, next in the MRO
        self._store.truncate(self.n_past)

    def features(self, start: int = 0, stop: int | None = None) -> npt.NDArray[np.float32]:
        """Features of positions [start, stop) (default: all n_past): (stop-start, len(layers)*n_embd)."""
        return self._store.rows(start, self.n_past if stop is None else stop)


class _CbEvalCapture:
    """A cb_eval callback that copies the tensors named in ``names`` (name → slot) per decode.

    ggml asks the callback about every node of every decode. The answer is memoized by node
    address: llama.cpp builds its graph in the same order into the same buffer, so a node keeps its
    address across decodes. A stale entry after a rebuild cannot capture the wrong tensor (the name
    is checked again before copying); one that misses a wanted tensor leaves a slot empty, and the
    backend then forgets the memo and redoes that decode (``LlamaFeatureBackend._decode``).
    The memo spares the callbacks reading every tensor name at every decode (docs/heads.md gives the
    callbacks' cost per step).
    """

    user_data = None  # cb_eval_user_data: this callback keeps its state on the Python object

    def __init__(self, names: Sequence[str], n_embd: int) -> None:
        import llama_cpp

        self._ggml = _ggml()
        self._n_embd = n_embd
        self._slots: dict[bytes, list[int]] = {}
        for slot, name in enumerate(names):
            self._slots.setdefault(name.encode(), []).append(slot)
        self._parts: list[npt.NDArray[np.float32] | None] = [None] * len(names)
        self._wanted: dict[int, bool] = {}  # node address → whether its name is wanted (memo)
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._on_tensor)

    def begin(self) -> None:
        self._parts = [None] * len(self._parts)

    def forget(self) -> bool:
        """Drop the address memo; whether there was one to drop."""
        had = bool(self._wanted)
        self._wanted = {}
        return had

    def _on_tensor(self, t: int, ask: bool, _user: int) -> bool:
        if ask:
            wanted = self._wanted.get(t)
            if wanted is None:
                wanted = self._wanted[t] = self._ggml.ggml_get_name(t) in self._slots
            return wanted
        slots = self._slots.get(self._ggml.ggml_get_name(t))
        if slots is None:
            self._wanted[t] = False  # a stale memo entry: another node lives here now
        else:
            g = self._ggml
            if ctypes.c_int32.from_address(t).value != 0 or not g.ggml_is_contiguous(t):  # GGML_TYPE_F32 = 0
                return False  # stops the graph: llama_decode fails and collect() reports it
            out = np.empty((g.ggml_nrows(t), self._n_embd), np.float32)
            if out.nbytes != g.ggml_nbytes(t):
                return False
            g.ggml_backend_tensor_get(t, out.ctypes.data, 0, out.nbytes)
            for s in slots:
                self._parts[s] = out
        return True

    def collect(self, n_tokens: int) -> list[npt.NDArray[np.float32]]:
        missing = [i for i, p in enumerate(self._parts) if p is None or len(p) != n_tokens]
        if missing:
            raise BackendError(f"cb_eval captured no {n_tokens}-row F32 tensor for feature slot(s) {missing}")
        return [p for p in self._parts if p is not None]


def attach_capture(cp: Any, names: list[str], n_embd: int, compiled: bool) -> tuple[Any, str]:
    """A cb_eval capture of the graph tensors `names` (rows of n_embd floats) set on the context params
    `cp`: the compiled callback where it builds, else the Python one. Returns it (it keeps the callback
    and its data alive: hold it as long as the context) and "c" or "python"."""
    lib = compiled_callback() if compiled else None
    capture = (CCapture(lib, _ggml(), names, n_embd, cp.n_batch) if lib is not None
               else _CbEvalCapture(names, n_embd))
    cp.cb_eval, cp.cb_eval_user_data = capture.callback, capture.user_data
    return capture, "c" if lib is not None else "python"


class LlamaFeatureBackend(StoredFeatures, LlamaCppBackend):
    """A llama.cpp target that also returns hidden states at a few layers for every evaluated token.

    Args:
        path: GGUF file of the target.
        layers: target layer ids (features = input of each layer); default EAGLE-3's
            ``eagle3_layer_ids(n_layer)``.
        method: "ext" (libllama's layer-input API; refused for archs outside ``EXT_ARCHS``),
            "cb_eval" (eval callback on ``l_out-<id-1>``), or "auto" (ext where allowed and
            exported, else cb_eval).
        compiled: run cb_eval through the compiled callback (``capture_c``) when it builds; False,
            or no C compiler: the Python callback.
        **kwargs: as for LlamaCppBackend.

    After ``eval`` (any ``rows``, chunked or not), ``features(start, stop)`` holds one row per
    position: (stop - start, len(layers) * n_embd) float32, the layers concatenated in the order
    given (EAGLE-3's low, mid, high). ``truncate`` drops the rows past the new length. A
    base.FeatureBackend.
    """

    def __init__(self, path: Any, *, layers: Sequence[int] | None = None, method: FeatureMethod = "auto",
                 compiled: bool = True, **kwargs: Any) -> None:
        if method not in ("auto", "ext", "cb_eval"):
            raise ValueError(f"method must be 'auto', 'ext' or 'cb_eval' (got {method!r})")
        self._want_layers, self._want_method = layers, method
        self._compiled = compiled
        self._capture: _CbEvalCapture | CCapture | None = None
        self.capture_impl: str | None = None  # cb_eval only: "c" (compiled callback) or "python"
        super().__init__(path, **kwargs)
        if self.feature_method == "ext":
            api = ext_api()
            assert api is not None
            for lid in sorted(set(self.feature_layers)):
                api.set_layer_inp(self._ctx, lid, True)
        self._store = FeatureStore(len(self.feature_layers) * self.n_embd)
        self._tree_rows: npt.NDArray[np.float32] | None = None  # note_tree's rows (tree order) until kept

    def _configure_context(self, cp: Any) -> None:
        ll = self._ll
        self.n_layer = ll.llama_model_n_layer(self._model)
        self.n_embd = ll.llama_model_n_embd(self._model)
        self.arch = self.metadata("general.architecture") or "?"
        if self.recurrent:  # its rollback re-evaluates tokens, which would append their feature rows again
            raise BackendError(f"feature heads need an attention-only target; {self.arch!r} has recurrent layers")
        layers = tuple(self._want_layers) if self._want_layers is not None else eagle3_layer_ids(self.n_layer)
        bad = [lid for lid in layers if not 1 <= lid <= self.n_layer - 1]
        if not layers or bad:
            raise ValueError(f"feature layer ids must be in 1..{self.n_layer - 1} for this "
                             f"{self.n_layer}-layer model (got {list(layers)})")
        self.feature_layers = layers
        ext_ok = self.arch in EXT_ARCHS and ext_api() is not None
        if self._want_method == "ext" and not ext_ok:
            why = ("libllama does not export the layer-input API" if ext_api() is None else
                   f"its layer-input capture aborts the process for arch {self.arch!r} (ext is used only for "
                   f"{', '.join(sorted(EXT_ARCHS))})")
            raise BackendError(f"method='ext' is unavailable: {why}; use method='cb_eval'")
        self.feature_method = "ext" if ext_ok and self._want_method != "cb_eval" else "cb_eval"
        if self.feature_method == "cb_eval":
            self._capture, self.capture_impl = attach_capture(cp, [f"l_out-{lid - 1}" for lid in layers],
                                                              self.n_embd, self._compiled)

    def _decode(self, chunk: Sequence[int], want: list[bool]) -> None:
        n = len(chunk)
        if self._capture is not None:
            while True:
                self._capture.begin()
                super()._decode(chunk, want)
                try:
                    parts = self._capture.collect(n)
                    break
                except BackendError:
                    LlamaCppBackend.truncate(self, self.n_past - n)  # keep KV and feature rows in step
                    if not self._capture.forget():  # a stale address memo: redo with fresh names
                        raise
        else:
            super()._decode(chunk, want)
            api = ext_api()
            assert api is not None
            parts = []
            for lid in self.feature_layers:
                ptr = api.get_layer_inp(self._ctx, lid)
                parts.append(np.ctypeslib.as_array(ptr, shape=(n, self.n_embd)))
        self._store.append(np.concatenate(parts, axis=1))

    def note_tree(self, parents: Sequence[int]) -> None:
        """Keep the feature rows of the draft tree llama_tree.eval_tree just scored (root + n nodes, its
        batch in llama_tree.preorder order) until ``keep_tree_path``; nothing if the capture missed them
        (then ``tree_rows_missing``, and llama_tree.keep_path evaluates the kept path again, in order)."""
        from edgespec.backends.llama_tree import preorder

        order = preorder(parents)
        n = len(order)
        self._tree_rows = None
        try:
            if self._capture is not None:
                parts = self._capture.collect(n)
            else:
                api = ext_api()
                assert api is not None
                parts = [np.ctypeslib.as_array(api.get_layer_inp(self._ctx, lid), shape=(n, self.n_embd))
                         for lid in self.feature_layers]
        except BackendError:
            return
        rows = np.concatenate(parts, axis=1)
        self._tree_rows = np.empty_like(rows)
        self._tree_rows[order] = rows  # batch row b is tree row order[b]

    def tree_rows_missing(self) -> bool:
        """Whether the last tree's feature rows were not captured (asked by llama_tree.keep_path)."""
        return self._tree_rows is None

    def keep_tree_path(self, path: Sequence[int]) -> None:
        """After llama_tree.keep_path(path): the feature rows of the root and the path's nodes become
        those of the last 1 + len(path) positions (a path evaluated again in order stored its own)."""
        tree, self._tree_rows = self._tree_rows, None
        if len(self._store) >= self.n_past or tree is None:
            return
        self._store.append(tree[[0, *(i + 1 for i in path)]])

    def token_embeddings(self) -> None:
        """None: a libllama head reads the target's weights through ctx_other, any other head from
        the target's GGUF (base.FeatureBackend)."""
        return None

    def lm_head_weights(self) -> None:
        """None, as for ``token_embeddings``."""
        return None
