"""A numpy forward of a llama-arch GGUF: an independent check of what llama.cpp computes (the tiny
test models, and single layers of real ones). Same primitives as the EAGLE-3 head reference."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from edgespec.backends.llama_features import LlamaFeatureBackend
from edgespec.gguf_file import read_gguf
from edgespec.heads.numpy_ops import attention, rms_norm, rope_norm, silu

F32 = npt.NDArray[np.float32]


class ExactAttention(LlamaFeatureBackend):
    """Flash attention off: llama.cpp's CPU flash attention rounds Q·K to F16 (measured: 1.5e-3 on
    the tiny models' layer-1 output); without it, F32 weights + F32 KV match numpy to ~1e-6."""

    def _configure_context(self, cp):
        super()._configure_context(cp)
        cp.flash_attn_type = 0  # LLAMA_FLASH_ATTN_TYPE_DISABLED


@dataclass
class LlamaWeights:
    n_layer: int
    n_head: int
    n_head_kv: int
    eps: float
    rope_base: float
    tensors: dict[str, F32]  # GGUF name → float32 (dequantized)

    @classmethod
    def load(cls, path: str | Path, layers: Sequence[int] | None = None) -> LlamaWeights:
        """The weights of ``path`` (only blocks in ``layers`` plus embeddings/output, if given)."""
        f = read_gguf(path, lambda k: k.startswith("llama."))
        kv = {k.removeprefix("llama."): f.value(k) for k in f.kv}
        keep = None if layers is None else {f"blk.{i}." for i in layers}
        names = [n for n in f.tensors if keep is None or not n.startswith("blk.") or n[: n.index(".", 4) + 1] in keep]
        n_head = kv["attention.head_count"]
        return cls(kv["block_count"], n_head, kv.get("attention.head_count_kv", n_head),
                   kv["attention.layer_norm_rms_epsilon"], kv.get("rope.freq_base", 10000.0),
                   {n: f.tensor(n) for n in names})

    def layer(self, il: int, x: F32, pos: npt.NDArray[np.int64]) -> F32:
        """Layer ``il`` on a whole sequence x (n, n_embd) at positions ``pos`` (no cache)."""
        W, b, n = self.tensors, f"blk.{il}.", len(x)
        d = x.shape[1] // self.n_head
        y = rms_norm(x, W[b + "attn_norm.weight"], self.eps).astype(np.float64)
        q = (y @ W[b + "attn_q.weight"].T).astype(np.float32).reshape(n, self.n_head, d)
        k = (y @ W[b + "attn_k.weight"].T).astype(np.float32).reshape(n, self.n_head_kv, d)
        v = (y @ W[b + "attn_v.weight"].T).astype(np.float32).reshape(n, self.n_head_kv, d)
        q, k = rope_norm(q, pos, d, self.rope_base), rope_norm(k, pos, d, self.rope_base)
        x = (attention(q, k, v, pos, pos, 1.0 / np.sqrt(d)).astype(np.float64) @ W[b + "attn_output.weight"].T + x)
        x = x.astype(np.float32)
        y = rms_norm(x, W[b + "ffn_norm.weight"], self.eps).astype(np.float64)
        ff = silu((y @ W[b + "ffn_gate.weight"].T).astype(np.float32)) * (y @ W[b + "ffn_up.weight"].T)
        return (ff @ W[b + "ffn_down.weight"].T + x).astype(np.float32)

    def logits(self, x: F32) -> F32:
        """Final norm and LM head (tied to token_embd when there is no output.weight)."""
        W = self.tensors
        out = W.get("output.weight", W["token_embd.weight"])
        return (rms_norm(x, W["output_norm.weight"], self.eps).astype(np.float64) @ out.T).astype(np.float32)


def llama_forward(path: str | Path, tokens: Sequence[int]) -> tuple[list[F32], F32]:
    """Run ``tokens`` from position 0 through the llama GGUF at ``path``.

    Returns:
        (layer_inputs, logits): layer_inputs[L] is the input of layer L (n, n_embd) for
        L = 0..n_layer (the last one is the final pre-norm state); logits (n, n_vocab).
    """
    w = LlamaWeights.load(path)
    pos = np.arange(len(tokens), dtype=np.int64)
    x = w.tensors["token_embd.weight"][np.asarray(tokens)]
    inputs = []
    for il in range(w.n_layer):
        inputs.append(x)
        x = w.layer(il, x, pos)
    inputs.append(x)
    return inputs, w.logits(x)


def rollback_features(b, tokens: Sequence[int]) -> np.ndarray:
    """On feature backend `b`: a prompt (tokens[:6]), a 4-token draft, keep 1 of it, append 2 others;
    asserts rows past n_past are gone and the kept ones unchanged (3 layers of n_embd 64) and returns
    the 9 rows, which should equal a fresh run of prompt + draft[:1] + [777, 4242]. Leaves `b` empty."""
    prompt, draft, fix = tokens[:6], tokens[6:10], [777, 4242]
    b.eval(prompt, rows="last")
    before = b.features()
    b.eval(draft, rows="all")
    b.truncate(7)
    assert b.features().shape == (7, 3 * 64)
    with pytest.raises(IndexError):
        b.features(0, 8)
    np.testing.assert_array_equal(b.features(0, 6), before)
    b.eval(fix, rows="all")
    got = b.features()
    b.truncate(0)
    assert b.features().shape == (0, 3 * 64)
    return got
