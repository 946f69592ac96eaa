"""The target's last hidden state (after its final norm) from the llama.cpp backend, in the same forward
pass: what Medusa heads read (drafters.medusa).

How, on the pinned libllama's terms (llama-cpp-python 0.3.36, vendor/llama.cpp):

* src/models/llama.cpp (and the other src/models/*.cpp graphs): the decoder output goes through the final
  norm and is named ``result_norm`` (``cb(cur, "result_norm", -1); res->t_embd = cur;``, l. 235), then the
  LM head makes ``result_output`` (the logits) from it. The last layer keeps only the rows whose logits
  were asked for (``ggml_get_rows(cur, inp_out_ids)``, l. 174-176), so ``result_norm`` has one row per
  OUTPUT of the batch, in batch order: exactly the rows whose logits ``eval`` returns.
* ``llama_set_embeddings(ctx, true)`` would hand the same tensor over (``llama_get_embeddings_ith``), but
  src/llama-context.cpp (l. 1734-1735: ``// when computing embeddings, all tokens are output``,
  ``const bool output_all = cparams.embeddings;``) then makes EVERY token of every batch an output: the LM
  head would run on every prompt token, and the logits buffer would no longer hold only the rows asked
  for. So it is not used.
* Instead a ggml eval callback copies ``result_norm`` as it is computed, as LlamaFeatureBackend copies
  ``l_out-<L>`` (the compiled ``capture_c`` callback where a C compiler is found, else the Python one).
  The logits are computed by the same graph, so they are unchanged (tests/test_medusa_drafter.py).

The rows are kept by KV position: position p has a row iff its logits were asked for when it was
evaluated, or it was the last token of its batch (``_decode`` makes that one an output too: one row of the
LM head). The position a drafter needs, n_past − 1 (the row whose logits chose the pending token), so has
one after any eval, a prompt's included. A draft tree scored by ``llama_tree.eval_tree`` (its own
llama_decode, not ``_decode``) is recorded only through two calls its caller makes: ``note_tree(parents)``
right after eval_tree (the capture still holds that decode's rows) and ``keep_tree_path(path)`` after
keep_path; without them ``hidden`` reports the kept positions missing (a Medusa drafter then drafts nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from edgespec.backends.capture_c import CCapture
from edgespec.backends.llama_cpp import LlamaCppBackend
from edgespec.backends.llama_features import _CbEvalCapture, attach_capture
from edgespec.errors import BackendError

F32 = npt.NDArray[np.float32]
HIDDEN_TENSOR = "result_norm"


class LlamaHiddenBackend(LlamaCppBackend):
    """A llama.cpp target that also keeps its final-norm hidden state h_p for every position p whose
    logits it returned (``hidden(p)``).

    Args:
        path: GGUF file of the target.
        compiled: capture through the compiled callback (``capture_c``) when it builds; False, or no
            C compiler: the Python callback.
        **kwargs: as for LlamaCppBackend.
    """

    def __init__(self, path: Any, *, compiled: bool = True, **kwargs: Any) -> None:
        self._compiled = compiled
        self._capture: _CbEvalCapture | CCapture | None = None
        self.capture_impl: str | None = None  # "c" (compiled callback) or "python"
        super().__init__(path, **kwargs)
        self._rows = np.empty((0, self.n_embd), np.float32)  # row p: h of position p (valid where _has[p])
        self._has = np.zeros(0, bool)
        self._tree_rows: F32 | None = None  # note_tree's rows (tree row order) until keep_tree_path

    def _configure_context(self, cp: Any) -> None:
        self.n_embd = int(self._ll.llama_model_n_embd(self._model))
        self._capture, self.capture_impl = attach_capture(cp, [HIDDEN_TENSOR], self.n_embd, self._compiled)

    def _decode(self, chunk: Sequence[int], want: list[bool]) -> None:
        assert self._capture is not None
        # the last token of every batch is an output too (a copy: eval counts its own list): a prompt
        # evaluated with rows="none" leaves h of its last position, which the first draft reads. eval
        # reads no logits of such a batch, and the KV cache is computed before the rows are selected
        want = [*want[:-1], True]
        n_out, start = sum(want), self.n_past
        while True:
            self._capture.begin()
            super()._decode(chunk, want)
            try:
                rows = self._capture.collect(n_out)[0]
                break
            except BackendError:
                LlamaCppBackend.truncate(self, self.n_past - len(chunk))
                if not self._capture.forget():  # a stale address memo: redo with fresh names
                    raise
        self._grow(start + len(chunk))
        self._has[start:start + len(chunk)] = want
        self._rows[start + np.flatnonzero(want)] = rows

    def _grow(self, need: int) -> None:
        if need > len(self._has):
            size = max(need, 2 * len(self._has), 64)
            rows, has = np.empty((size, self.n_embd), np.float32), np.zeros(size, bool)
            rows[: len(self._rows)], has[: len(self._has)] = self._rows, self._has
            self._rows, self._has = rows, has

    def note_tree(self, parents: Sequence[int]) -> None:
        """Keep the hidden rows of the draft tree llama_tree.eval_tree just scored (root + n nodes, its batch
        in llama_tree.preorder order) until ``keep_tree_path``; nothing if the capture missed them."""
        from edgespec.backends.llama_tree import preorder

        assert self._capture is not None
        order = preorder(parents)
        try:
            rows = self._capture.collect(len(order))[0]
        except BackendError:
            self._tree_rows = None
            return
        self._tree_rows = np.empty((len(order), self.n_embd), np.float32)
        self._tree_rows[order] = rows  # batch row b is tree row order[b]

    def keep_tree_path(self, path: Sequence[int]) -> None:
        """After llama_tree.keep_path(path) (or its in-order re-evaluation): the rows of the root and the
        path's nodes become those of the last 1 + len(path) positions."""
        tree, self._tree_rows = self._tree_rows, None
        if tree is None:
            return
        rows = tree[[0, *(i + 1 for i in path)]]
        start = self.n_past - len(rows)
        self._grow(self.n_past)
        self._rows[start:self.n_past], self._has[start:self.n_past] = rows, True

    def truncate(self, n_past: int) -> None:
        super().truncate(n_past)
        self._has[self.n_past:] = False

    def hidden(self, pos: int) -> F32 | None:
        """h of position `pos` (H,) float32 (a copy), or None when the target holds no row for it
        (not evaluated, evaluated without its logits, or rolled back)."""
        if not 0 <= pos < min(self.n_past, len(self._has)) or not self._has[pos]:
            return None
        return self._rows[pos].copy()

    def output_matrix(self) -> F32:
        """The target's LM head (V, H) as float32 numpy, read from its GGUF (``output.weight``, or the tied
        ``token_embd.weight``): what Medusa heads that share it multiply by."""
        from edgespec.gguf_file import read_gguf

        t = read_gguf(self.path)
        return np.asarray(t.tensor("output.weight" if "output.weight" in t.tensors else "token_embd.weight"),
                          np.float32)
