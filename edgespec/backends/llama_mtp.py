"""The llama.cpp side of MTP ("nextn") drafting: a target that keeps its nextn hidden rows, the MTP
draft context on the same model, and a Gemma-4 assistant's context on the target's (drafters.mtp,
drafters.assistant).

Upstream facts (llama-cpp-python 0.3.36 sdist, vendor/llama.cpp = ggml-org/llama.cpp@0c1e57098 per its
CHANGELOG):
* common/common.cpp: the target model is loaded with ``llama_model_params.load_mtp`` (else the nextn
  tensors are skipped: src/models/qwen35.cpp ``TENSOR_SKIP``), and the draft context is a second
  context on the SAME model with ``llama_context_params.ctx_type = LLAMA_CONTEXT_TYPE_MTP`` (graph
  ``LLM_GRAPH_TYPE_DECODER_MTP``; src/llama-model.cpp gives it a plain KV cache of the nextn layer
  only, even on the Gated-DeltaNet hybrids qwen35 / qwen35moe / qwen3next).
* common/speculative.cpp (``common_speculative_impl_draft_mtp``): ``llama_set_embeddings_nextn(ctx_tgt,
  true, masked=false)`` makes every target forward also return ``h_nextn`` for EVERY token of the
  batch (src/models/qwen35.cpp: ``output_norm`` of the last trunk layer, read with
  ``llama_get_embeddings_nextn``); the draft context is fed (token at p, target h of p-1) pairs,
  the first position with a zero row.
* src/llama-ext.h: ``llama_set_embeddings_nextn``, ``llama_get_embeddings_nextn(_ith)``: exported
  only under C++-mangled names (bound in backends/llama_features.py's ``ExtApi``).
* src/llama-context.cpp: with ``masked=true`` the extracted rows are the FIRST n_outputs rows of
  the graph's h tensor, and qwen35's MTP graph sets that tensor before it selects the output rows,
  so a batch whose only output is its last pair gets its first pair's row (measured on the fixture:
  equal to 5e-7, and 4.06 away from the last pair's); the draft context
  here therefore runs unmasked too (rows by batch index), so that a catch-up batch and the first
  draft step can share one forward.

``MTP_ARCHS`` lists the architectures whose src/models/*.cpp build a ``LLM_GRAPH_TYPE_DECODER_MTP``
graph in this libllama. qwen35 (a Gated-DeltaNet hybrid, tests/mtp_fixtures.py) and glm4moe (attention
only, MoE, tests/mtp_fixtures_glm.py) are exercised here; several nextn blocks
(step35's chained heads) are drafted with the first one alone.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from edgespec.backends.llama_cpp import KV_TYPES, LlamaCppBackend, LlamaHandles
from edgespec.backends.llama_features import ExtApi, FeatureStore, ext_api
from edgespec.errors import BackendError, EdgespecError, ModelLoadError

F32 = npt.NDArray[np.float32]
DECODE = 1  # enum llama_process_type
LLAMA_CONTEXT_TYPE_MTP = 1

# arch name (general.architecture) of every src/models/*.cpp with an LLM_GRAPH_TYPE_DECODER_MTP graph
MTP_ARCHS = frozenset({"qwen35", "qwen35moe", "qwen3next", "deepseek2", "deepseek32", "deepseek4", "glm4moe",
                       "glm-dsa", "glm5-next", "mimo2", "step35", "hy_v3", "nemotron_h_moe", "bailingmoe3",
                       "cohere2moe"})
# ... of which these assert exactly one nextn block (GGML_ASSERT: a second one would abort the process)
ONE_BLOCK_ARCHS = MTP_ARCHS - {"hy_v3", "mimo2", "step35", "glm5-next"}


class MtpUnavailableError(EdgespecError):
    """``--drafter mtp`` on a target that has no nextn layers, or whose MTP graph libllama lacks."""


def check_mtp_target(path: str | os.PathLike) -> tuple[str, int]:
    """(architecture, nextn layers) of a GGUF target, read from its header; one-line
    MtpUnavailableError when it has no nextn layers or this libllama has no MTP graph for its arch."""
    from edgespec.gguf_file import read_gguf

    try:
        g = read_gguf(path, keep_key=lambda k: k == "general.architecture" or k.endswith(".nextn_predict_layers"),
                      with_tensors=False)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    arch = str(g.value("general.architecture", "?"))
    key = f"{arch}.nextn_predict_layers"
    n = int(g.value(key, 0) or 0)
    if n <= 0:
        raise MtpUnavailableError(f"--drafter mtp: {path} (architecture {arch}) has no MTP layers ({key} is "
                                  f"{'absent' if key not in g.kv else 0}); use a GGUF converted with its MTP "
                                  f"layers, or another drafter")
    if arch not in MTP_ARCHS:
        raise MtpUnavailableError(f"--drafter mtp: {path} has {n} MTP layer(s) but this libllama (llama-cpp-python "
                                  f"0.3.36) has no MTP graph for architecture {arch} (it has one for "
                                  f"{', '.join(sorted(MTP_ARCHS))})")
    if n != 1 and arch in ONE_BLOCK_ARCHS:
        raise MtpUnavailableError(f"--drafter mtp: {path} has {n} MTP layers ({key}) but this libllama's {arch} MTP "
                                  f"graph takes exactly one")
    return arch, n


ASSISTANT_ARCHS = {"gemma4-assistant": "gemma4"}  # an assistant's arch -> the target arch it drafts for


def check_assistant(path: str | os.PathLike, target: str | os.PathLike | None) -> bool:
    """Whether `path` is a Gemma-4 assistant GGUF (read from its header); one-line MtpUnavailableError
    when it does not fit `target`: the target's architecture, hidden size or vocabulary differ."""
    p = Path(path).expanduser()
    if not p.is_file():  # "ngram", a model name
        return False
    from edgespec.gguf_file import read_gguf

    try:  # the header's architecture only: every draft model's file passes here
        arch = read_gguf(p, lambda k: k == "general.architecture", with_tensors=False).value("general.architecture")
    except (ValueError, OSError):
        return False
    if arch not in ASSISTANT_ARCHS or target is None:
        return arch in ASSISTANT_ARCHS
    try:
        a = read_gguf(p, lambda k: k.startswith((f"{arch}.", "tokenizer.ggml.tokens")), with_tensors=False)
        t = read_gguf(target, lambda k: k == "general.architecture" or k.endswith(".embedding_length")
                      or k == "tokenizer.ggml.tokens", with_tensors=False)
    except (ValueError, OSError):
        return True  # the backend reports what is wrong with the target file
    t_arch, want = t.value("general.architecture"), ASSISTANT_ARCHS[arch]
    if t_arch != want:
        raise MtpUnavailableError(f"assistant {p} ({arch}) drafts for a {want} target; {target} is {t_arch}")
    width, n_embd = a.value(f"{arch}.embedding_length_out"), t.value(f"{t_arch}.embedding_length")
    if width != n_embd:
        raise MtpUnavailableError(f"assistant {p} reads {width}-wide target rows ({arch}.embedding_length_out); "
                                  f"{target} is {n_embd} wide: it was made for another {want} size")
    a_tok, t_tok = a.value("tokenizer.ggml.tokens") or [], t.value("tokenizer.ggml.tokens") or []
    if a_tok != t_tok:
        first = next((i for i, (x, y) in enumerate(zip(a_tok, t_tok)) if x != y), min(len(a_tok), len(t_tok)))
        raise MtpUnavailableError(f"assistant {p} and target {target}: vocabularies differ ({len(a_tok)} vs "
                                  f"{len(t_tok)} tokens, first difference at id {first})")
    return True


def _api() -> ExtApi:
    api = ext_api()
    if api is None:
        raise BackendError("this libllama does not export the nextn-embeddings API the mtp drafter needs")
    return api


class LlamaMtpTarget(LlamaCppBackend):
    """A llama.cpp target loaded with its MTP layers (if it has any) that keeps, for every evaluated
    position p, the hidden row h_p an MTP head or a Gemma-4 assistant reads (``hidden(start, stop)``),
    rolled back with the KV cache. (``check_mtp_target`` is the planner's check that an MTP head exists.)

    The cost over a plain target: the nextn rows are copied out of every forward (n_embd floats a
    token), and the last trunk layer's FFN and norm run for every token of a prompt chunk (not only
    the rows whose logits are asked for). Args: as for LlamaCppBackend.
    """

    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        self._ext = _api()
        super().__init__(path, **kwargs)
        self.arch = self.metadata("general.architecture") or "?"
        self.n_nextn = self._ll.llama_model_n_layer_nextn(self._model)
        self.n_embd = self._ll.llama_model_n_embd_out(self._model)
        self._ext.set_nextn(self._ctx, True, False)  # every token's row, not only the outputs'
        self._h = FeatureStore(self.n_embd)

    def _load_model(self, path: Path, params: Any, what: str) -> None:
        params.load_mtp = True
        super()._load_model(path, params, what)

    def _decode(self, chunk: Any, want: list[bool]) -> None:
        self._h.truncate(self._n_past)  # a recurrent rollback replays positions whose rows were kept
        super()._decode(chunk, want)
        ptr = self._ext.get_nextn(self._ctx)
        if not ptr:
            raise BackendError(f"the {self.arch} target returned no nextn rows (llama_get_embeddings_nextn)")
        self._h.append(np.ctypeslib.as_array(ptr, shape=(len(chunk), self.n_embd)))

    def truncate(self, n_past: int) -> None:
        super().truncate(n_past)
        self._h.truncate(self.n_past)

    def hidden(self, start: int, stop: int) -> F32:
        """h rows of positions [start, stop) (the target's ``h_nextn``), (stop - start, n_embd), copied."""
        return self._h.rows(start, stop)


class _NextnContext(LlamaHandles):
    """A draft context reading (token, h row) pairs, with one reused ext batch (LlamaHandles frees the
    context and batch; ``_model`` only where it is this context's own)."""

    n_embd: int
    n_vocab: int
    n_batch: int

    def _start(self, model: Any, target: LlamaMtpTarget, kv_type: str | None, threads: int | None,
               ctx_other: Any = None) -> Any:
        """Create the context (ctx_type MTP) on `model`, sized like `target`'s; None if refused."""
        ll = self._ll
        self._api = _api()
        self.n_embd, self.n_vocab, self.n_batch = target.n_embd, target.n_vocab, target.n_batch
        cp = ll.llama_context_default_params()
        cp.n_ctx = target.n_ctx
        cp.n_batch = cp.n_ubatch = target.n_batch
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = threads or target.threads
        cp.type_k = cp.type_v = KV_TYPES[kv_type or target.kv_type]
        cp.ctx_type = LLAMA_CONTEXT_TYPE_MTP
        cp.no_perf = True
        if ctx_other is not None:
            cp.ctx_other = ctx_other
        self._ctx = ll.llama_init_from_model(model, cp)
        if self._ctx:
            self._api.set_nextn(self._ctx, True, False)
            self._mem = ll.llama_get_memory(self._ctx)
            self._batch, self._free_batch = ll.llama_batch_ext_init(self._ctx), ll.llama_batch_ext_free
            self._pos = (ll.llama_pos * 4)()
        return self._ctx

    def _run(self, tokens: list[int], h: F32, pos0: int) -> tuple[F32, F32]:
        """One llama_process of the pairs (tokens[i], h[i]) at positions pos0+i; the LAST pair's logits
        (V,) and its own h_nextn (n_embd,), both copied."""
        ll, n = self._ll, len(tokens)
        if n == 0 or n > self.n_batch or h.shape != (n, self.n_embd) or h.dtype != np.float32:
            raise ValueError(f"a draft forward takes 1..{self.n_batch} tokens and ({n}, {self.n_embd}) float32 rows "
                             f"(got {n} and {h.shape} {h.dtype})")
        h = np.ascontiguousarray(h)
        base = h.ctypes.data
        f32p = ctypes.POINTER(ctypes.c_float)
        ll.llama_batch_ext_clear(self._batch)
        for i, tok in enumerate(tokens):
            idx = ll.llama_batch_ext_add_token(self._batch, 0, int(tok))
            self._pos[0] = pos0 + i
            embd = ll.llama_embd(ctypes.cast(base + 4 * i * self.n_embd, f32p), 1, self.n_embd)
            if (idx < 0 or not ll.llama_batch_ext_set_pos(self._batch, idx, self._pos)
                    or not ll.llama_batch_ext_set_embd_token(self._batch, idx, embd)):
                raise BackendError(f"cannot add draft pair {i} (token {tok}) to the batch ({idx})")
            if i == n - 1:
                ll.llama_batch_ext_set_output_logits(self._batch, idx, True)
        rc = ll.llama_process(self._ctx, DECODE, self._batch)
        if rc != 0:
            raise BackendError(f"llama_process (draft) returned {rc} for {n} pairs at position {pos0}")
        logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(self._ctx, n - 1), shape=(self.n_vocab,)).copy()
        h_out = np.ctypeslib.as_array(self._api.get_nextn_ith(self._ctx, n - 1), shape=(self.n_embd,)).copy()
        return logits, h_out


class LlamaMtpContext(_NextnContext):
    """The MTP draft context: ``ctx_type`` MTP on the target's own model (not freed here), a KV cache
    of ``n_past`` positions on sequence 0.

    Args:
        target: the LlamaMtpTarget (must outlive this context).
        kv_type: the draft KV cache type (default: the target's).
        threads: CPU threads (default: the target's).
    """

    def __init__(self, target: LlamaMtpTarget, *, kv_type: str | None = None, threads: int | None = None) -> None:
        super().__init__()
        self._target = target  # its model is the one this context runs on: LlamaHandles must not free it
        if not self._start(target.llama_model, target, kv_type, threads):
            self.close()
            raise ModelLoadError(f"cannot create the MTP draft context of {target.path} (llama_init_from_model "
                                 f"with ctx_type MTP refused it; run with --verbose for llama.cpp's log)")
        self._n_past = 0

    @property
    def n_past(self) -> int:
        return self._n_past

    def decode(self, tokens: list[int], h: F32) -> tuple[F32, F32]:
        """Append the pairs (tokens[i], h[i]) at positions n_past+i; the last pair's logits and h."""
        try:
            out = self._run(tokens, h, self._n_past)
        except BackendError:
            self._ll.llama_memory_seq_rm(self._mem, 0, self._n_past, -1)
            raise
        self._n_past += len(tokens)
        return out

    def truncate(self, n_past: int) -> None:
        """Drop the KV entries of positions >= n_past."""
        if n_past >= self._n_past:
            return
        if not self._ll.llama_memory_seq_rm(self._mem, 0, n_past, -1):
            raise BackendError(f"llama_memory_seq_rm could not roll the MTP context back to {n_past}")
        self._n_past = n_past


class LlamaAssistantContext(_NextnContext):
    """A Gemma-4 assistant on llama.cpp: its own model, a context whose ``ctx_other`` is the target's
    (llama.cpp shares the target's KV cache of its last sliding-window and full-attention layers with
    it: src/llama-model.cpp), so it keeps no positions of its own. Every draft step is one pair at
    the target's next position (common/speculative.cpp, ``is_mem_shared``).

    Args:
        path: the assistant GGUF (arch ``gemma4-assistant``).
        target: the LlamaMtpTarget (must outlive this context).
        threads: CPU threads (default: the target's).
    """

    def __init__(self, path: str | os.PathLike, target: LlamaMtpTarget, *, threads: int | None = None) -> None:
        super().__init__()
        p = Path(path).expanduser()
        self._target = target
        self._load_model(p, self._ll.llama_model_default_params(), "load the assistant")
        if not self._start(self._model, target, None, threads, ctx_other=target.llama_context):
            self.close()
            raise ModelLoadError(f"cannot create the assistant context of {p} on {target.path} (run with --verbose "
                                 f"for llama.cpp's log)")

    def step(self, token: int, h: F32) -> tuple[F32, F32]:
        """The pair (token, h (n_embd,)) at the target's next position: logits (V,) and the next h."""
        return self._run([token], h[None], self._target.n_past)
