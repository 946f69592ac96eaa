"""Medusa heads (Cai et al., ICML 2024, arXiv 2401.10774): their config, a numpy forward and their
GGUF layout.

Upstream (FasterDecoding/Medusa ``medusa/model/medusa_model.py`` and ``medusa_model_legacy.py`` at
e2a5d20): each head k reads the target's last hidden state h (the decoder's output AFTER its final
norm, what the LM head reads) and applies ``medusa_num_layers`` residual blocks
``x ← x + SiLU(W x + b)`` (``ResBlock``: an ``nn.Linear(H, H)`` with bias, weight initialised to
zero) and then its output matrix (``nn.Linear(H, V, bias=False)``). Head k (0-based) at position p
predicts the token at p + k + 2 (train_legacy.py's labels ``[..., 2 + i:]``); the target's own LM
head predicts p + 1. Config "version" 2 heads (medusa_model_legacy.py since 2b8020f) have no output
matrix: they share the target's LM head (``shared_lm_head``), as heads trained here will.

GGUF layout (edgespec's own; llama.cpp has no Medusa architecture): architecture ``medusa``; UINT32
keys ``medusa.num_heads`` (K), ``medusa.num_layers`` (L), ``medusa.hidden_size`` (H),
``medusa.vocab_size`` (V) and BOOL ``medusa.shared_lm_head``; tensors ``blk.{k}.res.{j}.weight``
(numpy (H, H) = GGUF ne {H, H}), ``blk.{k}.res.{j}.bias`` (H, F32) for j < L and, unless shared,
``blk.{k}.output.weight`` (V, H). With a vocabulary source the file carries the target's
``tokenizer.*`` metadata, as the other head files do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

from edgespec.gguf_file import read_gguf
from edgespec.heads.gguf_io import WEIGHT_TYPES, finish_head_file, tokenizer_fields

F32 = npt.NDArray[np.float32]
ARCH = "medusa"


def res_weight(k: int, j: int) -> str:
    return f"blk.{k}.res.{j}.weight"


def res_bias(k: int, j: int) -> str:
    return f"blk.{k}.res.{j}.bias"


def output_weight(k: int) -> str:
    return f"blk.{k}.output.weight"


@dataclass(frozen=True)
class MedusaConfig:
    """Hyperparameters of a set of Medusa heads (the medusa.* keys of its GGUF)."""

    n_heads: int  # K
    n_layers: int  # L residual blocks per head
    n_embd: int  # H: the target's hidden size
    n_vocab: int  # V: the target's vocabulary
    shared_lm_head: bool = False  # no output matrices: the heads use the target's LM head

    def __post_init__(self) -> None:
        if self.n_heads < 1 or self.n_layers < 0 or self.n_embd < 1 or self.n_vocab < 1:
            raise ValueError(f"bad Medusa sizes: heads={self.n_heads} layers={self.n_layers} "
                             f"hidden={self.n_embd} vocab={self.n_vocab}")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """GGUF tensor name → numpy shape of every tensor the heads carry."""
        H, s = self.n_embd, {}
        for k in range(self.n_heads):
            for j in range(self.n_layers):
                s[res_weight(k, j)], s[res_bias(k, j)] = (H, H), (H,)
            if not self.shared_lm_head:
                s[output_weight(k)] = (self.n_vocab, H)
        return s

    def check_tensors(self, tensors: Mapping[str, npt.NDArray[Any]]) -> None:
        """ValueError naming the first missing, unknown or misshapen tensor."""
        want = self.shapes()
        for name, shape in want.items():
            if name not in tensors:
                raise ValueError(f"Medusa heads lack tensor {name} {shape}")
            if tuple(tensors[name].shape) != shape:
                raise ValueError(f"tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}")
        extra = sorted(set(tensors) - set(want))
        if extra:
            raise ValueError(f"unknown Medusa tensors: {', '.join(extra)}")


def silu64(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    return x / (1.0 + np.exp(-x))


class MedusaHead:
    """The numpy forward of K Medusa heads (float64 inside, float32 out): the oracle a drafter
    runtime is tested against.

    Args:
        config: the heads' hyperparameters.
        tensors: GGUF tensor name → array (see ``MedusaConfig.shapes``).
        lm_head: the target's output matrix (V, H), needed when ``config.shared_lm_head``
            (a tied target's token embeddings).
    """

    def __init__(self, config: MedusaConfig, tensors: Mapping[str, npt.NDArray[Any]],
                 lm_head: F32 | None = None) -> None:
        config.check_tensors(tensors)
        self.config = config
        self.tensors = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
        self.lm_head: npt.NDArray[np.float64] | None = None
        if config.shared_lm_head:
            want = (config.n_vocab, config.n_embd)
            if lm_head is None or tuple(lm_head.shape) != want:
                raise ValueError(f"Medusa heads sharing the target's LM head need it as a {want} matrix "
                                 f"(got {None if lm_head is None else tuple(lm_head.shape)})")
            self.lm_head = np.asarray(lm_head, np.float64)

    @classmethod
    def from_gguf(cls, path: str | Path, lm_head: F32 | None = None) -> MedusaHead:
        """The heads of a medusa GGUF (``lm_head``: see the class)."""
        return cls(*read_medusa_gguf(path), lm_head=lm_head)

    def states(self, h: F32) -> F32:
        """Each head's state after its residual blocks.

        Args:
            h: the target's last hidden states (n, H), after its final norm.

        Returns:
            (K, n, H) float32.
        """
        return self._states(h).astype(np.float32)

    def logits(self, h: F32) -> F32:
        """Each head's logits over the target vocabulary.

        Args:
            h: the target's last hidden states (n, H), after its final norm.

        Returns:
            (K, n, V) float32: row [k, i] predicts the token k + 2 positions after h[i]'s.
        """
        x = self._states(h)  # (K, n, H)
        if self.lm_head is not None:
            return (x @ self.lm_head.T).astype(np.float32)
        return np.stack([x[k] @ self.tensors[output_weight(k)].T for k in range(self.config.n_heads)]
                        ).astype(np.float32)

    def _states(self, h: F32) -> npt.NDArray[np.float64]:
        c = self.config
        h64 = np.asarray(h, np.float64)
        if h64.ndim != 2 or h64.shape[1] != c.n_embd:
            raise ValueError(f"hidden states must be (n, {c.n_embd}) (got {h64.shape})")
        out = np.empty((c.n_heads, *h64.shape))
        for k in range(c.n_heads):
            x = h64
            for j in range(c.n_layers):
                x = x + silu64(x @ self.tensors[res_weight(k, j)].T + self.tensors[res_bias(k, j)])
            out[k] = x
        return out


def write_medusa_gguf(path: str | Path, config: MedusaConfig, tensors: Mapping[str, npt.NDArray[Any]], *,
                      vocab_source: str | Path | None = None, weight_type: str = "f16",
                      name: str = "edgespec medusa heads", extra_kv: Mapping[str, str] | None = None) -> Path:
    """Write Medusa heads in edgespec's medusa GGUF layout (see the module doc).

    Args:
        path: output file.
        config: the heads' hyperparameters.
        tensors: GGUF tensor name → array (numpy shape = reversed GGUF ne).
        vocab_source: the target GGUF whose ``tokenizer.*`` metadata is copied (its vocabulary
            must have ``config.n_vocab`` tokens); None writes no tokenizer.
        weight_type: "f16", "q8_0" or "f32" for the matrices; biases stay F32.
        name: general.name.
        extra_kv: extra string metadata (e.g. ``edgespec.head.*`` provenance).

    Returns:
        ``path`` as a Path.
    """
    config.check_tensors(tensors)
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"weight_type must be one of {', '.join(WEIGHT_TYPES)} (got {weight_type!r})")
    tok = tokenizer_fields(vocab_source) if vocab_source is not None else {}
    if tok and len(tok["tokenizer.ggml.tokens"][0]) != config.n_vocab:
        raise ValueError(f"{vocab_source} has {len(tok['tokenizer.ggml.tokens'][0])} tokens but the heads' "
                         f"config says n_vocab={config.n_vocab}")
    w = gguf.GGUFWriter(Path(path), ARCH)
    w.add_name(name)
    w.add_file_type({"f32": 0, "f16": 1, "q8_0": 7}[weight_type])
    w.add_uint32(f"{ARCH}.num_heads", config.n_heads)
    w.add_uint32(f"{ARCH}.num_layers", config.n_layers)
    w.add_uint32(f"{ARCH}.hidden_size", config.n_embd)
    w.add_uint32(f"{ARCH}.vocab_size", config.n_vocab)
    w.add_bool(f"{ARCH}.shared_lm_head", config.shared_lm_head)
    finish_head_file(w, tok, tensors, weight_type, extra_kv)
    return Path(path)


def read_medusa_gguf(path: str | Path) -> tuple[MedusaConfig, dict[str, F32]]:
    """Read Medusa heads written by ``write_medusa_gguf``: their config and tensors (float32).
    Raises ValueError if the file is not a medusa GGUF or its tensors do not fit its keys."""
    f = read_gguf(path, lambda k: not k.startswith("tokenizer."))
    arch = f.value("general.architecture")
    if arch != ARCH:
        raise ValueError(f"{path} is not a Medusa head file (general.architecture={arch!r})")
    config = MedusaConfig(
        n_heads=int(f.arch_value("num_heads")), n_layers=int(f.arch_value("num_layers")),
        n_embd=int(f.arch_value("hidden_size")), n_vocab=int(f.arch_value("vocab_size")),
        shared_lm_head=bool(f.arch_value("shared_lm_head", False)))
    tensors = {name: f.tensor(name) for name in f.tensors}
    config.check_tensors(tensors)
    return config, tensors
