"""MLX backend: an mlx-lm model class (`mlx_lm.models.<arch>.Model`) with mlx-lm KV caches.

Rollback is a cache trim. Sliding-window layers (Gemma 3) get a full KVCache with the window
applied by the attention mask instead of mlx-lm's RotatingKVCache, which cannot be trimmed once it
wraps: the same choice as llama.cpp's swa_full. Recurrent layers (mlx-lm's ArraysCache: Mamba,
Mamba-2, LFM2's short convolutions, gated DeltaNet, RWKV-7; also inside a CacheList, as Falcon-H1)
make the backend `recurrent`: `checkpoint` keeps their state arrays, and `truncate` puts them back,
trims the KV layers to the checkpoint and re-evaluates from there (base.StateCheckpoint). A model
with any other cache is refused when it is opened, naming the layer type.

A GGUF file is converted once (mlx_convert.py; cached under $EDGESPEC_HOME/mlx) and tokenized by
llama.cpp's own tokenizer from its metadata (a vocab-only load), so token ids match the llama.cpp
backend exactly. An mlx-lm model directory without tokenizer.gguf uses its tokenizer.json (hf_vocab.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from edgespec.backends.base import Closing, LogitRows, StateCheckpoint, VocabInfo, check_room, join_rows
from edgespec.backends.deps import import_mlx
from edgespec.errors import ModelLoadError

# Model types whose Model.__call__ is `lm_head(self.model(...))` (or the tied embedding): for them
# the LM head runs only on the rows asked for. Others run whole and are sliced.
_SPLIT_HEAD = {"llama", "gemma3_text", "lfm2"}


def mlx_model_dir(path: str | os.PathLike, note: Callable[[str], None] | None = None) -> Path:
    """The MLX model directory for `path` (a file or directory, not a model name): an mlx-lm directory as
    it is, a GGUF file converted once and cached (the assembler's plan converts; later calls find it)."""
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"{p} is not an MLX model directory (no config.json)")
        return p
    from edgespec.backends.llama_cpp import check_gguf_file
    from edgespec.backends.mlx_convert import cached_conversion

    check_gguf_file(p)
    return cached_conversion(p, note=note)


def rollback_caches(model: Any, model_type: str) -> list[Any]:
    """The model's mlx-lm caches, sliding-window ones replaced by full KVCaches (see the module
    docstring); ModelLoadError naming the first layer whose cache can neither be trimmed (KVCache)
    nor checkpointed (ArraysCache)."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    caches = [KVCache() if isinstance(c, RotatingKVCache) else c for c in make_prompt_cache(model)]
    for i, c in enumerate(caches):
        for part in _cache_parts(c):
            if not (_is_state(part) or isinstance(part, KVCache) and part.is_trimmable()):
                raise ModelLoadError(
                    f"model type {model_type!r} is not supported: layer {i} keeps a {type(part).__name__}, "
                    "which can neither be trimmed nor checkpointed for speculative decoding")
    return caches


def _cache_parts(cache: Any) -> tuple[Any, ...]:
    """The caches one layer keeps: a CacheList's members (Falcon-H1: state + KV), else the cache."""
    from mlx_lm.models.cache import CacheList

    return tuple(cache.caches) if isinstance(cache, CacheList) else (cache,)


def _is_state(cache: Any) -> bool:
    from mlx_lm.models.cache import ArraysCache

    return isinstance(cache, ArraysCache)


class MlxBackend(Closing):
    """A model on MLX (mlx-lm model classes and caches).

    Args:
        path: an mlx-lm model directory (config.json + *.safetensors) or a GGUF file (converted once and
            cached, by edgespec.session's plan when it assembles the engine).
        n_ctx: context size in tokens (MLX caches grow; this is the limit `eval` enforces).
        n_batch: most tokens per forward pass (longer prompts are chunked).
        threads, n_gpu_layers: accepted for the shared options; MLX chooses its own threads and device.
        verbose: show llama.cpp's log while reading tokenizer.gguf.
        vocab: an object with the Backend vocabulary calls (tokenize, token_to_bytes, is_eog,
            vocab_fingerprint, metadata, bos_id, eos_id, add_bos, n_vocab, close) to use instead of the
            directory's tokenizer: tests give tiny models a letters vocabulary this way.
    """

    name = "mlx"
    recurrent = False

    def __init__(self, path: str | os.PathLike, *, n_ctx: int = 4096, n_batch: int = 512,
                 threads: int | None = None, n_gpu_layers: int = 0, verbose: bool = False,
                 vocab: Any = None) -> None:
        self._vocab: Any = None
        self._mx = mx = import_mlx()
        from mlx_lm.utils import load_model

        self.path = str(Path(path).expanduser())  # the GGUF file or MLX directory the user named
        self.model_dir = mlx_model_dir(self.path, note=lambda line: print(line, file=sys.stderr))
        config = json.loads((self.model_dir / "config.json").read_text())
        self.model_type = str(config.get("model_type"))
        try:
            model, _ = load_model(self.model_dir, lazy=True)  # weights are read at mx.eval below
        except (ValueError, FileNotFoundError) as e:
            raise ModelLoadError(f"mlx-lm cannot load {self.model_dir}: {e}") from e
        self._set_caches(rollback_caches(model, self.model_type))  # refuse before reading the weights
        self.recurrent = bool(self._states)
        self._checkpoint = StateCheckpoint()
        mx.eval(model.parameters())
        self.model = model
        self._split = self.model_type in _SPLIT_HEAD
        self.n_ctx, self.n_batch = n_ctx, n_batch
        self.threads = 0  # MLX chooses its own (the cost-profile key)
        self._n_past = 0
        self._vocab = vocab if vocab is not None else _open_vocab(self.model_dir, verbose)
        self.n_vocab = int(config.get("vocab_size") or self._vocab.n_vocab)
        self.bos_id, self.eos_id, self.add_bos = self._vocab.bos_id, self._vocab.eos_id, self._vocab.add_bos

    # -- tokens: the vocabulary object's --------------------------------------------------------------

    @property
    def n_past(self) -> int:
        return self._n_past

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self._vocab.tokenize(text, add_special, parse_special)

    def token_to_bytes(self, token: int) -> bytes:
        return self._vocab.token_to_bytes(token)

    def is_eog(self, token: int) -> bool:
        return self._vocab.is_eog(token)

    def vocab_fingerprint(self) -> VocabInfo:
        return dataclasses.replace(self._vocab.vocab_fingerprint(), n_vocab=self.n_vocab)

    def metadata(self, key: str) -> str | None:
        return self._vocab.metadata(key)

    # -- evaluation -------------------------------------------------------------------------------

    def eval(self, tokens: Sequence[int], rows: LogitRows = "last") -> npt.NDArray[np.float32]:
        return join_rows(self._chunks(tokens, rows), self.n_vocab)

    def eval_argmax(self, tokens: Sequence[int]) -> npt.NDArray[np.int64]:
        parts = self._chunks(tokens, "argmax")
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    def _chunks(self, tokens: Sequence[int], rows: LogitRows | Literal["argmax"]) -> list[npt.NDArray[Any]]:
        """Evaluate `tokens` in forwards of at most n_batch; the rows each returns (see _forward)."""
        n = len(tokens)
        check_room(self._n_past, n, self.n_ctx)
        out = []
        for start in range(0, n, self.n_batch):
            chunk = list(tokens[start:start + self.n_batch])
            last_chunk = start + self.n_batch >= n
            want = rows if rows in ("all", "argmax") else ("last" if rows == "last" and last_chunk else "none")
            logits = self._forward(chunk, want)
            self._n_past += len(chunk)
            if self.recurrent:
                self._checkpoint.evaluated(chunk)
            if logits is not None:
                out.append(logits)
        return out

    def _forward(self, chunk: list[int], want: LogitRows | Literal["argmax"]) -> npt.NDArray[Any] | None:
        """One forward of `chunk`: its logit rows as `want` says (float32), or with "argmax" each
        row's argmax taken on the device (int64)."""
        mx, model = self._mx, self.model
        inputs = mx.array([chunk])  # (1, L)
        if self._split:
            h = model.model(inputs, cache=self._caches)  # (1, L, H)
            if want == "none":
                mx.eval(h, self._cache_arrays())
                return None
            h = h[:, -1:] if want == "last" else h
            logits = self.lm_head()(h)  # (1, rows, V)
        else:
            logits = model(inputs, cache=self._caches)  # (1, L, V), lazy: computed only if evaluated
            if want == "none":  # a prompt chunk or a rollback's replay: no LM head at all
                mx.eval(self._cache_arrays())
                return None
            logits = logits[:, -1:] if want == "last" else logits
        if want == "argmax":  # γ+1 ids cross to the host instead of γ+1 rows of V floats
            ids = mx.argmax(logits[0], axis=-1)
            mx.eval(ids, self._cache_arrays())
            return np.array(ids, dtype=np.int64)
        logits = logits.astype(mx.float32)
        mx.eval(logits, self._cache_arrays())
        return np.array(logits[0], copy=True)

    def _cache_arrays(self) -> list[Any]:
        """What a forward pass computes into the caches (mx.eval'd with its logits)."""
        return [(c.keys, c.values) for c in self._kv] + [c.cache for c in self._states]

    def _set_caches(self, caches: list[Any]) -> None:
        self._caches = caches
        parts = [p for c in caches for p in _cache_parts(c)]
        self._states = [p for p in parts if _is_state(p)]  # recurrent layers' ArraysCaches
        self._kv = [p for p in parts if not _is_state(p)]  # trimmable KVCaches

    def checkpoint(self) -> None:
        """Keep the recurrent layers' state arrays at n_past (a no-op on an attention-only model).
        mlx arrays are values: every forward pass stores new ones in the cache, never writes into
        the old, so holding the references is the copy."""
        if self.recurrent:
            self._checkpoint.take([list(c.cache) for c in self._states], self._n_past)

    @property
    def checkpoint_at(self) -> int | None:
        return self._checkpoint.position

    def truncate(self, n_past: int) -> None:
        """Trim the KV caches to `n_past`; on a recurrent model, first put the checkpoint's state back
        (KV layers trimmed to it too) and re-evaluate the tokens from there to `n_past`."""
        if n_past >= self._n_past:
            return
        if not self.recurrent:
            for c in self._kv:
                c.trim(c.offset - n_past)
            self._n_past = n_past
            return
        if n_past == 0:
            self._set_caches(rollback_caches(self.model, self.model_type))
            self._checkpoint.clear()
            self._n_past = 0
            return
        replay = self._checkpoint.replay(self._n_past, n_past)  # BackendError without a checkpoint
        at = self._checkpoint.at
        for c, arrays in zip(self._states, self._checkpoint.state):
            c.cache = list(arrays)
        for c in self._kv:
            c.trim(c.offset - at)
        self._n_past = at
        self.eval(replay, rows="none")  # recorded again: the checkpoint stays usable

    def lm_head(self) -> Callable[[Any], Any]:
        """The target's LM head as a function of final-norm hidden states, mx (..., H) → (..., V): its
        ``lm_head`` module or the tied embeddings' ``as_linear`` (quantized or not), as `eval` applies it
        to the split-head model types."""
        model = self.model
        return model.lm_head if "lm_head" in model else model.model.embed_tokens.as_linear

    def token_embeddings(self) -> Any:
        """The target's token embeddings (V, H) as an mx array, unscaled (what llama.cpp's EAGLE-3
        head reads from the target's token_embd): the weight itself, or dequantized once."""
        emb = self.model.model.embed_tokens
        if "scales" not in emb:  # nn.Embedding: no copy
            return emb.weight
        return emb(self._mx.arange(self.n_vocab))  # nn.QuantizedEmbedding: dequantized rows

    def lm_head_weights(self) -> Any:
        """The target's LM head (V, H) as an mx array (what a DFlash head without its own reads):
        the lm_head weight itself, dequantized once if quantized, or the tied token embeddings."""
        if "lm_head" not in self.model:
            return self.token_embeddings()
        head = self.model.lm_head
        if "scales" not in head:  # nn.Linear: no copy
            return head.weight
        return self._mx.dequantize(head.weight, head.scales, head.get("biases"), head.group_size, head.bits,
                                   mode=getattr(head, "mode", "affine"))  # nn.QuantizedLinear

    def close(self) -> None:
        if self._vocab is not None:
            self._vocab.close()
            self._vocab = None
        self._set_caches([])


def _open_vocab(model_dir: Path, verbose: bool) -> Any:
    """llama.cpp's tokenizer from tokenizer.gguf (converted GGUFs), else the directory's tokenizer.json."""
    from edgespec.backends.mlx_convert import TOKENIZER_FILE

    if (model_dir / TOKENIZER_FILE).is_file():
        from edgespec.backends.llama_cpp import LlamaVocab

        return LlamaVocab(model_dir / TOKENIZER_FILE, verbose=verbose)
    from edgespec.backends.hf_vocab import HfVocab

    return HfVocab(model_dir)
