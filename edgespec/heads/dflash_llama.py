"""A DFlash head GGUF run by libllama itself, the way llama.cpp's common/speculative.cpp drives it
(``common_speculative_impl_draft_dflash``, 0.3.36).

The head is loaded as a llama.cpp model (arch ``dflash``) with its own context; with a target, the
context's ``ctx_other`` is the target's, so a head without ``token_embd`` / ``output`` reads the
target model's (llama.cpp refuses the context otherwise). Two kinds of ``llama_process(DECODE)``:

* inject: an embd batch of fused target-feature rows (T·H wide) at their positions p = n_past.. and
  no outputs: the graph runs fc + hidden norm and writes each layer's K/V of g_p into the head's
  KV cache (speculative.cpp's ``process()``);
* block: a token batch [anchor, MASK…] at the positions after the context, every row an output →
  logits over the target vocabulary (−inf outside d2t). The block's own K/V entries are dropped
  right after (``llama_memory_seq_rm``), so the cache holds only injected context, as in the
  numpy oracle (tests/head_oracles.py), whose ``forward_block`` leaves the cache unchanged.

DSpark (``markov``): llama.cpp's graph adds the Markov bias to the logits it returns, chained
greedily (row r gets w2·w1[prev_r], prev_1 = the anchor, prev_r = the argmax of the biased row
r−1; ``build_dspark_markov_head``). The bindings cannot switch that off, so ``forward_block``
removes it host-side with the same F32 weights read from the GGUF (the writer keeps them F32) and
returns the base logits with the normed hiddens (``llama_set_embeddings``: the graph's t_embd), as
the numpy oracle's ``forward_block`` does. DSparkDrafter reads ``chained_block`` instead (the rows
as llama.cpp biased them, and its chain) and swaps a row's bias only where the token it really
drafted differs from llama.cpp's argmax (never when greedy); it computes the confidence from h. (llama.cpp's own confidence, in the nextn
embeddings, is for the argmax chain only, so edgespec does not use it.)

The block's attention mask is the context default, which llama.cpp takes from the model's
``dflash.attention.causal`` (false: DFlash's non-causal block; tested both ways). Block size and
MASK id come from ``dflash.block_size`` (speculative.cpp's default 16 without it) and the
vocabulary's mask token.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from edgespec.backends.llama_cpp import LlamaCppBackend
from edgespec.errors import BackendError, ModelLoadError
from edgespec.gguf_file import read_gguf
from edgespec.heads.dspark import MarkovHead
from edgespec.heads.llama_head import DECODE, F32, LlamaHeadContext


class LlamaDFlashHead(LlamaHeadContext):
    """A DFlash head on llama.cpp: same interface as the numpy oracle (tests/head_oracles.py), for drafting
    (inject / truncate / n_past / block_tokens / block_logits / draft, block_size, mask_token_id).

    Args:
        path: the head GGUF (llama.cpp's dflash layout).
        target: the target backend (its context becomes ``ctx_other`` and must outlive this head),
            or None for a standalone context (the head must carry token_embd and output).
        n_ctx, n_batch: context and batch size (default: the target's; standalone 4096 and 512).
        kv_type: the head's KV cache type ("f16", llama.cpp's default, or "f32", "q8_0").
        flash_attn: llama.cpp's flash attention (on CPU it rounds Q·K to F16).
        threads: CPU threads (default: the target's; standalone 1).
        markov: a DSpark head's Markov head, read from the same GGUF (required for a DSpark file:
            its logits come back biased and ``forward_block`` must remove that).
    """

    def __init__(self, path: str | os.PathLike, target: LlamaCppBackend | None = None, *,
                 n_ctx: int | None = None, n_batch: int | None = None, kv_type: str = "f16",
                 flash_attn: bool = True, threads: int | None = None, markov: MarkovHead | None = None) -> None:
        super().__init__(path, target, kind="DFlash", n_ctx=n_ctx, n_batch=n_batch, kv_type=kv_type,
                         flash_attn=flash_attn, threads=threads)
        ll = self._ll
        arch = self.metadata("general.architecture")
        if arch != "dflash" or not self.target_layers:
            self.close()
            raise ModelLoadError(f"{self.path} is not a DFlash head (architecture {arch!r}, "
                                 f"target layers {self.target_layers})")
        self.n_embd_enc = len(self.target_layers) * self.n_embd  # llama.cpp requires H == H_t
        self.block_size = int(self.metadata("dflash.block_size") or 16)
        self.mask_token_id = int(ll.llama_vocab_mask(ll.llama_model_get_vocab(self._model)))
        if not 0 <= self.mask_token_id < self.n_vocab:
            self.close()
            raise ModelLoadError(f"{self.path} has no usable MASK token (tokenizer.ggml.mask_token_id)")
        if self.n_batch < self.block_size:
            self.close()
            raise ValueError(f"n_batch {self.n_batch} cannot hold a block of {self.block_size} tokens")
        is_dspark = "markov_w1.weight" in read_gguf(self.path, lambda k: False).tensors
        if is_dspark != (markov is not None):
            self.close()
            raise ValueError(f"{self.path} is {'a DSpark' if is_dspark else 'a plain DFlash'} head: "
                             f"{'pass its MarkovHead' if is_dspark else 'it has no Markov head to pass'} (markov=)")
        self.markov = markov

    def inject(self, features: F32) -> None:
        """Append target positions n_past.. to the context cache: (n, T·H) fused feature rows, in
        chunks of n_batch (an embd decode each, no outputs)."""
        ll, f = self._ll, np.ascontiguousarray(features, np.float32)
        if f.ndim != 2 or f.shape[1] != self.n_embd_enc:
            raise ValueError(f"features must be (n, {self.n_embd_enc}) (got {f.shape})")
        if self._n_past + len(f) > self.n_ctx:
            raise BackendError(f"{self._n_past} + {len(f)} positions exceed the head's context of {self.n_ctx}")
        for start in range(0, len(f), self.n_batch):
            chunk = f[start:start + self.n_batch]
            ll.llama_batch_ext_clear(self._batch)
            for i, row in enumerate(chunk):
                idx = ll.llama_batch_ext_add_embd(self._batch, 0, self._embd(row))
                p = self._n_past + i
                if idx < 0 or not self._set_pos(idx, (p, p, p, 0)):
                    raise BackendError(f"cannot add feature row {start + i} to the inject batch ({idx})")
            try:
                self._process(DECODE, f"inject {len(chunk)} rows at position {self._n_past}")
            except BackendError:
                self._seq_rm(self._n_past)
                raise
            self._n_past += len(chunk)

    def block_tokens(self, anchor: int, n: int | None = None) -> list[int]:
        """[anchor, MASK×(n−1)], n = block_size by default (common/speculative.cpp's noise block)."""
        n = self.block_size if n is None else n
        return [int(anchor)] + [self.mask_token_id] * (n - 1)

    def block_logits(self, tokens: Sequence[int]) -> F32:
        """Logits (b, V) of a block at positions n_past..n_past+b−1 attending to the context cache
        and the whole block (−inf outside the draft vocabulary); the cache is left unchanged. A
        DSpark head's rows 1.. carry llama.cpp's greedy Markov chain (see the module docstring)."""
        return self._block(tokens, hidden=False)[0]

    def forward_block(self, tokens: Sequence[int]) -> tuple[F32, F32]:
        """The numpy head's forward_block: (base logits (b, V) without any Markov bias, normed
        hidden (b, H))."""
        if self.markov is None:
            logits, h = self._block(tokens, hidden=True)
            assert h is not None
            return logits, h
        logits, h, chain = self.chained_block(tokens)
        for r in range(1, len(tokens)):
            logits[r] = self.markov.apply(logits[r], chain[r - 1], sign=-1.0)
        return logits, h

    def chained_block(self, tokens: Sequence[int]) -> tuple[F32, F32, list[int]]:
        """The block as llama.cpp returns it: (logits (b, V), a DSpark head's rows r ≥ 1 biased with
        the Markov bias of chain[r−1]; normed hidden (b, H); chain = [anchor, argmax of rows
        1..b−2], llama.cpp's greedy in-graph chain (ggml_argmax: first max))."""
        logits, h = self._block(tokens, hidden=True)
        assert h is not None
        return logits, h, [int(tokens[0])] + [int(np.argmax(r)) for r in logits[1:-1]]

    def _block(self, tokens: Sequence[int], hidden: bool) -> tuple[F32, F32 | None]:
        ll, b = self._ll, len(tokens)
        if not 1 <= b <= self.block_size:
            raise ValueError(f"a block holds 1..{self.block_size} tokens (got {b})")
        if self._n_past + b > self.n_ctx:
            raise BackendError(f"a block of {b} at position {self._n_past} exceeds the head's context of {self.n_ctx}")
        ll.llama_batch_ext_clear(self._batch)
        for i, tok in enumerate(tokens):
            idx = ll.llama_batch_ext_add_token(self._batch, 0, int(tok))
            p = self._n_past + i
            if idx < 0 or not self._set_pos(idx, (p, p, p, 0)):
                raise BackendError(f"cannot add block token {i} ({tok}) to the batch ({idx})")
            ll.llama_batch_ext_set_output_logits(self._batch, idx, True)
        ll.llama_set_embeddings(self._ctx, hidden)  # t_embd = the output-normed hidden, besides logits
        try:
            self._process(DECODE, f"block of {b} at position {self._n_past}")
            h = None
            if hidden:
                h = np.stack([np.ctypeslib.as_array(ll.llama_get_embeddings_ith(self._ctx, i), shape=(self.n_embd,))
                              for i in range(b)]).astype(np.float32)
            return self._logits(b), h
        finally:
            ll.llama_set_embeddings(self._ctx, False)
            self._seq_rm(self._n_past)  # the block's K/V never stays: the next features go there

    def draft(self, anchor: int, n_draft: int | None = None) -> list[int]:
        """Greedy drafts after ``anchor`` (at position n_past): argmax of block rows 1..n_draft."""
        n_draft = self.block_size - 1 if n_draft is None else n_draft
        if not 1 <= n_draft < self.block_size:
            raise ValueError(f"n_draft must be in 1..{self.block_size - 1} (got {n_draft})")
        return [int(i) for i in self.block_logits(self.block_tokens(anchor, n_draft + 1))[1:].argmax(axis=1)]
