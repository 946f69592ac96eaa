"""GGUF files for heads: what every head layout shares (the llama hyperparameters, the target's
tokenizer, the weight types) and llama.cpp's EAGLE-3 layout. Files are read with ``edgespec.gguf_file``.

EAGLE-3 layout (vendored llama.cpp 0.3.36: src/models/eagle3.cpp, src/llama-arch.cpp,
conversion/llama.py): architecture ``eagle3``; keys ``eagle3.target_layers`` (INT32 array of 3),
``eagle3.target_hidden_size`` (UINT32), optional ``eagle3.norm_before_residual`` /
``eagle3.norm_before_fc`` (BOOL) plus the usual llama hyperparameters under ``eagle3.*``; tensors
``fc.weight``, ``blk.0.{attn_norm,attn_norm_2,attn_q,attn_k,attn_v,attn_output,ffn_norm,ffn_gate,
ffn_up,ffn_down}.weight``, ``output_norm.weight``, ``output.weight``, ``d2t`` (I64: absolute target
token id of each draft id), optional ``enc.output_norm.weight``, ``token_embd.weight`` and
``rope_freqs.weight`` (F32, n_rot/2: llama3 RoPE scaling's divisors; no rope.scaling.* key). The file
carries the target's ``tokenizer.*`` metadata (llama.cpp needs the vocabulary: the d2t scatter is
``n_vocab`` wide, and its draft/target compatibility check compares vocabularies).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

from edgespec.gguf_file import Field, add_fields, read_gguf
from edgespec.heads.eagle3 import Eagle3Config

ARCH = "eagle3"


def tokenizer_fields(target: str | Path) -> dict[str, Field]:
    """Every ``tokenizer.*`` key of a target GGUF, to copy into a head file."""
    f = read_gguf(target, lambda k: k.startswith("tokenizer."), with_tensors=False)
    if "tokenizer.ggml.tokens" not in f.kv:
        raise ValueError(f"{target} has no tokenizer.ggml.tokens: not a usable vocabulary source")
    return {k: v for k, v in f.kv.items() if k.startswith("tokenizer.")}


# Weight types a head can be written in (1-D tensors, d2t and rows that Q8_0 cannot block stay as they are).
WEIGHT_TYPES = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
                "q8_0": gguf.GGMLQuantizationType.Q8_0}


def write_eagle3_gguf(path: str | Path, config: Eagle3Config, tensors: Mapping[str, npt.NDArray[Any]], *,
                      vocab_source: str | Path, weight_type: str = "f16", name: str = "edgespec eagle3 head",
                      extra_kv: Mapping[str, str] | None = None) -> Path:
    """Write an EAGLE-3 head in llama.cpp's layout.

    Args:
        path: output file.
        config: the head's hyperparameters.
        tensors: GGUF tensor name → array (numpy shape = reversed GGUF ne; ``d2t`` int64), as
            ``Eagle3Head.tensors`` holds them.
        vocab_source: the target GGUF; its ``tokenizer.*`` metadata is copied.
        weight_type: "f16", "q8_0" or "f32" for the 2-D weights; norms stay F32, d2t I64. A Q8_0
            matrix whose rows are not a multiple of 32 values is written as F16.
        name: general.name.
        extra_kv: extra string metadata (e.g. ``edgespec.head.*`` provenance).

    Returns:
        ``path`` as a Path.
    """
    config.check_tensors(tensors)
    w, tok = start_head_file(path, ARCH, config, n_layer=1, vocab_source=vocab_source, weight_type=weight_type,
                             name=name)
    w.add_uint32(f"{ARCH}.target_hidden_size", config.n_embd_tgt)
    w.add_bool(f"{ARCH}.norm_before_residual", config.norm_before_residual)
    w.add_bool(f"{ARCH}.norm_before_fc", config.norm_before_fc)
    finish_head_file(w, tok, tensors, weight_type, extra_kv)
    return Path(path)


def start_head_file(path: str | Path, arch: str, config: Any, *, n_layer: int, vocab_source: str | Path,
                    weight_type: str, name: str) -> tuple[gguf.GGUFWriter, dict[str, Any]]:
    """A GGUF writer for a draft head of architecture ``arch`` with the llama hyperparameters every
    head layout shares (context_length … vocab_size, ``<arch>.target_layers``) already added, and the
    target's ``tokenizer.*`` fields for ``finish_head_file``. ``config`` has the attributes of
    Eagle3Config/DFlashConfig; its n_vocab must match the vocabulary source."""
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"weight_type must be one of {', '.join(WEIGHT_TYPES)} (got {weight_type!r})")
    tok = tokenizer_fields(vocab_source)
    n_vocab = len(tok["tokenizer.ggml.tokens"][0])
    if n_vocab != config.n_vocab:
        raise ValueError(f"{vocab_source} has {n_vocab} tokens but the head's config says n_vocab={config.n_vocab}")
    w = gguf.GGUFWriter(Path(path), arch)
    w.add_name(name)
    w.add_file_type({"f32": 0, "f16": 1, "q8_0": 7}[weight_type])
    w.add_context_length(config.context_length)
    w.add_embedding_length(config.n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(config.n_ff)
    w.add_head_count(config.n_head)
    w.add_head_count_kv(config.n_head_kv)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_layer_norm_rms_eps(config.rms_eps)
    w.add_rope_freq_base(config.rope_base)
    w.add_rope_dimension_count(config.n_rot)
    w.add_vocab_size(config.n_vocab)
    w.add_key_value(f"{arch}.target_layers", list(config.target_layers), gguf.GGUFValueType.ARRAY,
                    gguf.GGUFValueType.INT32)
    return w, tok


def finish_head_file(w: gguf.GGUFWriter, tok: Mapping[str, Any], tensors: Mapping[str, npt.NDArray[Any]],
                     weight_type: str, extra_kv: Mapping[str, str] | None,
                     types: Mapping[str, str] | None = None) -> None:
    """Add the tokenizer fields, ``extra_kv`` and the tensors (2-D weights in ``weight_type``, or in
    the weight type ``types`` names for them; a Q8_0 matrix whose rows are not a multiple of 32 values
    as F16; 1-D F32; d2t I64), write and close."""
    types = types or {}
    add_fields(w, tok)
    for key, text in (extra_kv or {}).items():
        w.add_string(key, text)
    for tname, arr in tensors.items():
        if tname == "d2t":
            w.add_tensor(tname, np.ascontiguousarray(arr, np.int64), raw_dtype=gguf.GGMLQuantizationType.I64)
            continue
        arr = np.ascontiguousarray(arr, np.float32)
        t = WEIGHT_TYPES[types.get(tname, weight_type)] if arr.ndim == 2 else gguf.GGMLQuantizationType.F32
        if t == gguf.GGMLQuantizationType.Q8_0 and arr.shape[-1] % 32:
            t = gguf.GGMLQuantizationType.F16
        data = gguf.quants.quantize(arr, t)
        w.add_tensor(tname, data, raw_dtype=t if data.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read_eagle3_gguf(path: str | Path) -> tuple[Eagle3Config, dict[str, npt.NDArray[Any]]]:
    """Read an EAGLE-3 head written in llama.cpp's layout: its config and its tensors (float32,
    d2t int64). Raises ValueError if the file is not an eagle3 GGUF."""
    f = read_gguf(path, lambda k: not k.startswith("tokenizer.") or k == "tokenizer.ggml.tokens")
    arch = f.value("general.architecture")
    if arch != ARCH:
        raise ValueError(f"{path} is not an EAGLE-3 head (general.architecture={arch!r})")
    key = f.arch_value
    n_head = int(key("attention.head_count"))
    n_embd = int(key("embedding_length"))
    tensors = {name: f.tensor(name) for name in f.tensors}
    n_vocab = f.value(f"{ARCH}.vocab_size") or len(f.value("tokenizer.ggml.tokens", []))
    config = Eagle3Config(
        n_embd=n_embd, n_head=n_head, n_head_kv=int(key("attention.head_count_kv", n_head)),
        n_ff=int(key("feed_forward_length")), n_embd_tgt=int(key("target_hidden_size")),
        target_layers=tuple(int(x) for x in key("target_layers")), n_vocab=int(n_vocab),
        n_draft_vocab=len(tensors["d2t"]) if "d2t" in tensors else int(n_vocab),
        head_dim=int(key("attention.key_length", n_embd // n_head)),
        rms_eps=float(key("attention.layer_norm_rms_epsilon")), rope_base=float(key("rope.freq_base", 10000.0)),
        n_rot=int(key("rope.dimension_count", n_embd // n_head)), context_length=int(key("context_length")),
        norm_before_residual=bool(key("norm_before_residual", False)), norm_before_fc=bool(key("norm_before_fc", False)))
    config.check_tensors(tensors)
    return config, tensors
