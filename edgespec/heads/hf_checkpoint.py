"""What converting a published head reads: a Hugging Face checkpoint directory (config.json plus
safetensors weights, one file or shards with ``model.safetensors.index.json``) and the target GGUF's
header. Used by ``edgespec.heads.convert`` and its per-architecture converters.

Safetensors is read here directly (format: an 8-byte little-endian header length, a JSON header
naming each tensor's dtype, shape and byte range, then the raw little-endian data;
huggingface/safetensors README, "Format"), memory-mapped, so no tensor is loaded before it is
converted and BF16 needs no torch. Pickle checkpoints (``.bin``, ``.pt``, ...) are never loaded:
unpickling runs whatever code the file names.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from edgespec.errors import EdgespecError

INDEX = "model.safetensors.index.json"
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_FLOATS = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
_INTS = {"I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "BOOL": np.dtype("?"), "U8": np.dtype("u1")}


class CheckpointError(EdgespecError):
    """A head checkpoint cannot be converted: unreadable, unsupported, or not made for the target."""


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes are: file, safetensors dtype, shape, absolute byte range [start, end)."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    span: tuple[int, int]


@dataclass(frozen=True)
class Checkpoint:
    """A head checkpoint directory: its config.json and its tensors (read on demand)."""

    path: Path
    config: dict[str, Any]
    refs: dict[str, TensorRef]

    @property
    def files(self) -> tuple[Path, ...]:
        """config.json and every weight file, in a fixed order (what the content hash covers)."""
        return (self.path / "config.json", *sorted({r.file for r in self.refs.values()}))

    def shape(self, name: str) -> tuple[int, ...]:
        return self.refs[name].shape

    def dtype(self, name: str) -> str:
        return self.refs[name].dtype

    def array(self, name: str) -> npt.NDArray[Any]:
        """Tensor ``name``: float32 for F32/F16/BF16, int64 for integer and bool tensors."""
        r = self.refs[name]
        start, end = r.span
        raw = np.memmap(r.file, np.uint8, "r", offset=start, shape=(end - start,)) if end > start \
            else np.empty(0, np.uint8)
        if r.dtype == "BF16":  # the top 16 bits of a float32
            return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(r.shape)
        if r.dtype in _FLOATS:
            return raw.view(_FLOATS[r.dtype]).astype(np.float32).reshape(r.shape)
        return raw.view(_INTS[r.dtype]).astype(np.int64).reshape(r.shape)


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open a head checkpoint directory (config.json + safetensors); CheckpointError naming the
    directory and what is wrong (no config, pickle weights only, a malformed file)."""
    d = Path(path).expanduser()
    if not d.is_dir():
        raise CheckpointError(f"{d} is not a directory (a head checkpoint is a directory with config.json)")
    try:
        config = json.loads((d / "config.json").read_text())
    except OSError:
        raise CheckpointError(f"{d} has no config.json: not a Hugging Face checkpoint directory") from None
    except ValueError as e:
        raise CheckpointError(f"{d}/config.json is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{d}/config.json does not hold a JSON object")
    if (d / INDEX).is_file():
        try:
            weight_map = json.loads((d / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{d / INDEX} is not a safetensors index (no weight_map: {e})") from None
        files = [d / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{d / INDEX} names shards that are not there: {', '.join(missing)}")
    else:
        weight_map, files = None, sorted(d.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in d.iterdir() if p.suffix in PICKLES)
        if pickles:
            raise CheckpointError(f"{d} holds only pickle weights ({', '.join(pickles)}): edgespec never unpickles a "
                                  "checkpoint (loading a pickle runs the code it names); convert it to safetensors first")
        raise CheckpointError(f"{d} has no *.safetensors weights")
    refs: dict[str, TensorRef] = {}
    for f in files:
        for name, ref in _header(f).items():
            if name in refs:
                raise CheckpointError(f"tensor {name} is in both {refs[name].file.name} and {f.name}")
            refs[name] = ref
    if weight_map is not None:
        absent = sorted(n for n, f in weight_map.items() if n not in refs or refs[n].file.name != f)
        if absent:
            raise CheckpointError(f"{d / INDEX} maps {absent[0]} to a shard that does not hold it")
    return Checkpoint(d, config, refs)


def _header(f: Path) -> dict[str, TensorRef]:
    """The tensors a safetensors file holds; CheckpointError on anything malformed."""
    size = f.stat().st_size
    with open(f, "rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            raise CheckpointError(f"{f} is not a safetensors file (header length {n}, file size {size})")
        try:
            header = json.loads(fh.read(n))
        except ValueError as e:
            raise CheckpointError(f"{f} has a malformed safetensors header: {e}") from None
    refs = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (begin, end) = info["dtype"], tuple(int(x) for x in info["shape"]), info["data_offsets"]
        if dtype not in _FLOATS and dtype not in _INTS:
            raise CheckpointError(f"{f.name}: tensor {name} has dtype {dtype}; edgespec converts BF16, F16 and F32 "
                                  "weights (and integer d2t/t2d)")
        itemsize = (_FLOATS.get(dtype) or _INTS[dtype]).itemsize
        if end - begin != itemsize * int(np.prod(shape)) or 8 + n + end > size:
            raise CheckpointError(f"{f.name}: tensor {name} {dtype}{list(shape)} does not fit bytes {begin}..{end} "
                                  f"(file size {size}: truncated?)")
        refs[name] = TensorRef(f, dtype, shape, (8 + n + begin, 8 + n + end))
    return refs


@dataclass(frozen=True)
class TargetInfo:
    """What a head is checked against: the target GGUF's architecture, sizes and vocabulary."""

    path: Path
    arch: str
    n_embd: int
    n_layer: int
    n_vocab: int
    embd_type: str  # ggml type name of token_embd.weight ("F16", "Q8_0", ...)

    def token_embd(self) -> npt.NDArray[np.float32]:
        """The target's token embeddings (V, H) as float32 (dequantized)."""
        from edgespec.gguf_file import read_gguf

        return read_gguf(self.path, lambda k: False).tensor("token_embd.weight")


def read_target(path: str | os.PathLike) -> TargetInfo:
    """The header of a target GGUF; CheckpointError if it is not a usable target file."""
    from edgespec.gguf_file import read_gguf

    p = Path(path).expanduser()
    if not p.is_file():
        raise CheckpointError(f"the target {p} is not a GGUF file (a head is converted against its target's GGUF)")
    try:
        f = read_gguf(p, lambda k: k == "general.architecture" or k == "tokenizer.ggml.tokens"
                      or k.endswith((".embedding_length", ".block_count")))
        arch = f.require("general.architecture")
        n_vocab = len(f.require("tokenizer.ggml.tokens"))
        info = TargetInfo(p, arch, int(f.arch_value("embedding_length")), int(f.arch_value("block_count")), n_vocab,
                          f.tensors["token_embd.weight"][0].name if "token_embd.weight" in f.tensors else "none")
    except (ValueError, OSError) as e:
        raise CheckpointError(f"cannot read the target {p}: {e}") from None
    return info


def same_as_target(embd: npt.NDArray[np.float32], target: TargetInfo) -> bool:
    """Whether a head's embed_tokens is a copy of the target's token embeddings: equal within
    bf16 rounding (2⁻⁸ relative) when the target stores them as F32/F16/BF16. A quantized target's
    are not compared (its rounding would be taken for a difference), so such a copy is kept."""
    if target.embd_type not in ("F32", "F16", "BF16") or embd.shape != (target.n_vocab, target.n_embd):
        return False
    t = target.token_embd()
    tol = np.float32(2.0**-8) * np.abs(t) + np.float32(1e-6) * np.sqrt(np.mean(t * t, dtype=np.float64))
    return bool(np.all(np.abs(embd - t) <= tol))


# -- checks both converters make ----------------------------------------------------------------------


def core_sizes(ckpt: Checkpoint, hp: dict[str, Any], target: TargetInfo) -> tuple[int, int, int, int]:
    """(hidden_size, num_attention_heads, vocab_size, intermediate_size) of a head config, the
    vocabulary checked against the target's; CheckpointError naming a missing key or the mismatch."""
    try:
        h, n_head, n_vocab, n_ff = (int(hp[k]) for k in ("hidden_size", "num_attention_heads", "vocab_size",
                                                          "intermediate_size"))
    except KeyError as e:
        raise CheckpointError(f"{ckpt.path}/config.json lacks {e.args[0]}") from None
    if n_vocab != target.n_vocab:
        raise CheckpointError(f"{ckpt.path} has a vocabulary of {n_vocab} tokens, but target {target.path} has "
                              f"{target.n_vocab}")
    return h, n_head, n_vocab, n_ff


def check_plain_rope(ckpt: Checkpoint, hp: dict[str, Any], kind: str,
                     scalings: tuple[str, ...] = ()) -> dict[str, Any]:
    """The config's RoPE parameters (transformers v5's rope_parameters or the older rope_scaling);
    CheckpointError naming the type for RoPE scaling other than ``scalings`` (the head implements
    plain RoPE and those) and for partial rotary embeddings."""
    rope = hp.get("rope_parameters") or hp.get("rope_scaling") or {}
    scaling = rope.get("rope_type", rope.get("type", "default"))
    if scaling not in ("default", *scalings):
        also = "".join(f" and {s} scaling" for s in scalings)
        raise CheckpointError(f"{ckpt.path} uses RoPE scaling {scaling!r}; edgespec's {kind} head implements plain "
                              f"RoPE{also} only")
    if rope.get("partial_rotary_factor", hp.get("partial_rotary_factor", 1.0)) != 1.0:
        raise CheckpointError(f"{ckpt.path} uses partial rotary embeddings; edgespec's {kind} head rotates whole heads")
    return rope


def llama3_rope_factors(ckpt: Checkpoint, rope: dict[str, Any], base: float, dim: int) -> npt.NDArray[np.float32]:
    """llama.cpp's ``rope_freqs.weight`` for llama3 RoPE scaling (conversion/llama.py
    generate_extra_tensors; transformers' _compute_llama3_parameters): per rotated pair i, the
    divisor of its inverse frequency base^(−2i/dim), 1 for wavelengths below
    original_max_position_embeddings / high_freq_factor, ``factor`` above … / low_freq_factor,
    smoothly in between; in float32, as llama.cpp's torch code computes it (equal to it but for
    rare 1-ulp differences of torch's pow)."""
    try:
        factor, low, high, old_ctx = (rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                         "original_max_position_embeddings"))
    except KeyError as e:
        raise CheckpointError(f"{ckpt.path}: llama3 RoPE scaling lacks {e.args[0]}") from None
    f32 = np.float32
    powed = np.float64(base) ** (np.arange(0, dim, 2, dtype=f32) / f32(dim)).astype(np.float64)
    inv_freq = f32(1.0) / powed.astype(f32)  # torch's float32 pow is (nearly) the rounded float64 one
    wavelen = (f32(1.0) / inv_freq) * f32(2 * np.pi)  # torch's scalar / tensor is reciprocal(tensor) · scalar
    smooth = ((f32(1.0) / wavelen) * f32(old_ctx) - f32(low)) / f32(high - low) if high != low \
        else np.zeros_like(wavelen)
    mid = f32(1.0) / ((f32(1.0) - smooth) / f32(factor) + smooth)
    return np.where(wavelen < f32(old_ctx / high), f32(1.0),
                    np.where(wavelen > f32(old_ctx / low), f32(factor), mid)).astype(np.float32)


def rope_theta(hp: dict[str, Any], default: float) -> float:
    """The RoPE base, from transformers v5's rope_parameters or the older rope_theta."""
    return float((hp.get("rope_parameters") or {}).get("rope_theta", hp.get("rope_theta", default)))


def absolute_d2t(ckpt: Checkpoint, name: str, n_draft: int, n_vocab: int) -> npt.NDArray[np.int64]:
    """A d2t tensor of offsets (EAGLE's convention: draft id i is target id i + d2t[i]) as absolute
    ids, checked: one per lm_head row, distinct, inside the target vocabulary."""
    off = ckpt.array(name).reshape(-1)
    d2t = off + np.arange(off.size, dtype=np.int64)
    if off.size != n_draft or d2t.min() < 0 or d2t.max() >= n_vocab or len(np.unique(d2t)) != off.size:
        raise CheckpointError(f"{ckpt.path}: d2t (offsets) does not map the {n_draft} lm_head rows to distinct "
                              f"target ids in 0..{n_vocab - 1}")
    return d2t


def drop_target_copy(tensors: dict[str, npt.NDArray[Any]], source: str, target: TargetInfo,
                     say: Callable[[str], None]) -> None:
    """Remove token_embd.weight from ``tensors`` if it is a copy of the target's (see ``same_as_target``)."""
    embd = tensors.get("token_embd.weight")
    if embd is not None and same_as_target(embd, target):
        del tensors["token_embd.weight"]
        say(f"{source} is a copy of the target's token embeddings: dropped (borrowed at run time)")


def check_shapes(ckpt: Checkpoint, tensors: dict[str, npt.NDArray[Any]], shapes: dict[str, tuple[int, ...]],
                 names: dict[str, str]) -> None:
    """CheckpointError naming (by its checkpoint name) the first tensor whose shape is not ``shapes``'."""
    for gname, shape in shapes.items():
        if gname in tensors and tuple(tensors[gname].shape) != shape:
            raise CheckpointError(f"{ckpt.path}: {names.get(gname, gname)} has shape {list(tensors[gname].shape)}, "
                                  f"expected {list(shape)}")
