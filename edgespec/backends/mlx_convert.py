"""GGUF → MLX: a model directory mlx-lm loads (config.json + model.safetensors) plus tokenizer.gguf.

Quantized weights stay quantized (MLX affine, group 32):
- files of only Q4_0 / Q4_1 / Q8_0 (and float) tensors load natively with `mx.load(path.gguf)`;
- in other files, Q4_0, Q4_1, Q8_0, Q4_K, Q5_0, Q5_1 and Q5_K map exactly onto 4-, 5- and 8-bit
  group 32: each 32-value group already is scale·q + bias (Q4_K: scale d·sc, bias −dmin·m; Q5_0:
  d and −16·d; Q8_0: d and −128·d), with scales kept as float32, so there is no rounding at all;
  the integers are repacked into MLX's bit stream;
- any other quantized type (Q6_K with its 16-value groups, Q2_K, ...) is dequantized with the
  `gguf` package and re-quantized to `bits` (8 by default): said per tensor in the report;
- F32/F16/BF16 tensors stay float (float32).
GGUF llama Q/K rows are permuted for llama.cpp's interleaved RoPE: the config says
rope_traditional=True instead of un-permuting. Gemma's GGUF norm weights carry +1 (llama.cpp's
converter adds it; mlx-lm's Gemma RMSNorm adds it at run time): it is taken off again.
Mamba-2, LFM2 and Qwen3.5 (recurrent / hybrid; qwen35: mlx_convert_qwen35.py) invert llama.cpp's converter: ssm_a = −exp(A_log) becomes
A_log again, the squeezed depthwise conv kernels get back their (channels, kernel, 1) shape, and
LFM2's per-layer head_count_kv (0 on convolution layers) becomes full_attn_idxs.
tokenizer.gguf holds the source's metadata (vocabulary, merges, chat template) and no tensors:
the MLX backend tokenizes with llama.cpp's tokenizer from it (a vocab-only load).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgespec.backends import mlx_convert_qwen35 as qwen35
from edgespec.errors import ModelLoadError
from edgespec.gguf_file import GGUFFile, add_fields, read_gguf

GROUP = 32  # every GGUF block format maps onto MLX group size 32
CONVERTER_VERSION = 2  # part of the cache key: bump when the output format changes
TOKENIZER_FILE = "tokenizer.gguf"
REPORT_FILE = "edgespec-convert.json"
_NATIVE = {"Q4_0", "Q4_1", "Q8_0"}  # mx.load reads these as MLX quantized arrays
_FLOAT = {"F32", "F16", "BF16"}

# GGUF tensor name pieces → mlx-lm module paths (the part after "blk.N."), per architecture
_ATTENTION = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj"}
_LLAMA_LAYER = {**_ATTENTION, "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm"}
# ffn_norm is the norm before the MLP: llama calls it post_attention_layernorm, gemma3 has four norms
_ARCH_LAYER_NAMES = {
    "llama": {**_LLAMA_LAYER, "ffn_norm": "post_attention_layernorm"},
    "gemma3": {**_LLAMA_LAYER, "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    "mamba2": {"attn_norm": "norm", "ssm_in": "mixer.in_proj", "ssm_conv1d": "mixer.conv1d",
               "ssm_norm": "mixer.norm", "ssm_out": "mixer.out_proj"},
    "lfm2": {**_ATTENTION, "attn_output": "self_attn.out_proj", "attn_q_norm": "self_attn.q_layernorm",
             "attn_k_norm": "self_attn.k_layernorm", "attn_norm": "operator_norm", "ffn_norm": "ffn_norm",
             "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2",
             "shortconv.in_proj": "conv.in_proj", "shortconv.conv": "conv.conv", "shortconv.out_proj": "conv.out_proj"},
    "qwen35": qwen35.LAYER_NAMES,  # Qwen3.5 dense: mlx_convert_qwen35.py
}
_LAYER_PARAMS = {"mamba2": {"ssm_a": "mixer.A_log", "ssm_d": "mixer.D", "ssm_dt.bias": "mixer.dt_bias"},
                 "qwen35": qwen35.PARAMS}  # whole names
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ARCH_GLOBAL_NAMES = {"mamba2": {"token_embd": "backbone.embeddings", "output_norm": "backbone.norm_f", "output": "lm_head"},
                      "lfm2": {"token_embd": "model.embed_tokens", "token_embd_norm": "model.embedding_norm"}}
_LAYERS = {"mamba2": "backbone.layers"}  # where the blocks are (default model.layers)


@dataclass
class Conversion:
    """What convert_gguf did: the output directory and how each tensor was carried over."""

    out_dir: Path
    arch: str
    treatment: dict[str, str] = field(default_factory=dict)  # mlx name → "q4_1 native", "q4_k → 4-bit", ...

    def summary(self) -> str:
        counts = Counter(self.treatment.values())
        return f"{self.arch}: " + ", ".join(f"{n} × {how}" for how, n in sorted(counts.items()))

    @property
    def requantized(self) -> list[str]:
        return [name for name, how in self.treatment.items() if "re-quantized" in how]


def _mx():
    from edgespec.backends.deps import import_mlx

    return import_mlx()


def mlx_config(f: GGUFFile) -> dict[str, Any]:
    """mlx-lm config.json for a llama, gemma3, mamba2, lfm2 or qwen35 GGUF's metadata (ValueError naming a
    missing key)."""
    arch = f.value("general.architecture")
    if arch not in _ARCH_LAYER_NAMES:
        raise ModelLoadError(f"cannot convert GGUF architecture {arch!r} to MLX "
                             f"(supported: {', '.join(_ARCH_LAYER_NAMES)})")
    if arch in _RECURRENT_CONFIGS:
        return _RECURRENT_CONFIGS[arch](f, len(f.require("tokenizer.ggml.tokens")))
    get = f.arch_value
    n_head = get("attention.head_count")
    n_vocab = len(f.require("tokenizer.ggml.tokens"))
    cfg: dict[str, Any] = dict(
        hidden_size=get("embedding_length"), num_hidden_layers=get("block_count"),
        intermediate_size=get("feed_forward_length"), num_attention_heads=n_head,
        num_key_value_heads=get("attention.head_count_kv", n_head), rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        vocab_size=n_vocab, max_position_embeddings=get("context_length"),
        head_dim=get("attention.key_length", get("embedding_length") // n_head),
        tie_word_embeddings="output.weight" not in f.tensors)
    scaling = f.value(f"{arch}.rope.scaling.type", "none")
    if arch == "llama":
        if scaling != "none":
            raise ModelLoadError(f"cannot convert: rope scaling {scaling!r} is not supported for llama GGUFs yet")
        cfg.update(model_type="llama", rope_theta=get("rope.freq_base", 10000.0), rope_traditional=True)
    else:  # gemma3: llama.cpp's fixed pattern (every 6th layer global) and local RoPE base
        cfg.update(model_type="gemma3_text", rope_theta=get("rope.freq_base", 1_000_000.0),
                   rope_local_base_freq=get("rope.freq_base_swa", 10000.0),
                   sliding_window=get("attention.sliding_window"),
                   sliding_window_pattern=get("attention.sliding_window_pattern", 6),
                   query_pre_attn_scalar=cfg["head_dim"])
        if scaling == "linear":
            cfg["rope_scaling"] = {"type": "linear", "factor": get("rope.scaling.factor")}
        elif scaling != "none":
            raise ModelLoadError(f"cannot convert: rope scaling {scaling!r} is not supported for gemma3 GGUFs")
    return cfg


def _mamba2_config(f: GGUFFile, n_vocab: int) -> dict[str, Any]:
    get = f.arch_value
    n_head, d_inner, n_group = get("ssm.time_step_rank"), get("ssm.inner_size"), get("ssm.group_count", 1)
    if n_group != 1:  # llama.cpp normalizes y per group; mlx-lm's gated RMSNorm spans all of d_inner
        raise ModelLoadError(f"cannot convert: mamba2 with ssm.group_count {n_group} (mlx-lm's norm needs 1)")
    if "blk.0.ssm_norm.weight" not in f.tensors:
        raise ModelLoadError("cannot convert: a mamba2 GGUF without ssm_norm (mlx-lm always applies it)")
    return dict(model_type="mamba2", num_heads=n_head, head_dim=d_inner // n_head, vocab_size=n_vocab,
                hidden_size=get("embedding_length"), intermediate_size=d_inner, state_size=get("ssm.state_size"),
                num_hidden_layers=get("block_count"), layer_norm_epsilon=get("attention.layer_norm_rms_epsilon"),
                conv_kernel=get("ssm.conv_kernel"), n_groups=n_group, use_bias=False,
                use_conv_bias="blk.0.ssm_conv1d.bias" in f.tensors, time_step_rank=n_head,
                time_step_limit=[0.0, math.inf],  # llama.cpp's ssm_scan does not clamp dt
                tie_word_embeddings="output.weight" not in f.tensors, max_position_embeddings=get("context_length"))


def _lfm2_config(f: GGUFFile, n_vocab: int) -> dict[str, Any]:
    get = f.arch_value
    n_layer, n_embd, n_head = get("block_count"), get("embedding_length"), get("attention.head_count")
    kv = get("attention.head_count_kv")
    kv = [int(k) for k in kv] if isinstance(kv, (list, tuple)) else [int(kv)] * n_layer
    attn = [i for i, k in enumerate(kv) if k > 0]
    problem = ("it has no attention layer" if not attn
               else "its attention layers differ in head_count_kv" if len({kv[i] for i in attn}) > 1
               else "it has a sliding window" if f.value("lfm2.attention.sliding_window", 0)
               else "its head size is not embedding_length / head_count"
               if get("attention.key_length", n_embd // n_head) != n_embd // n_head
               else "mlx-lm's lfm2 ties the output head to the token embeddings, this file has output.weight"
               if "output.weight" in f.tensors else None)
    if problem:
        raise ModelLoadError(f"cannot convert this lfm2 GGUF to MLX: {problem}")
    return dict(model_type="lfm2", vocab_size=n_vocab, hidden_size=n_embd, num_hidden_layers=n_layer,
                num_attention_heads=n_head, num_key_value_heads=kv[attn[0]],
                max_position_embeddings=get("context_length"), norm_eps=get("attention.layer_norm_rms_epsilon"),
                conv_bias=False, conv_L_cache=get("shortconv.l_cache"), block_dim=n_embd,
                block_ff_dim=get("feed_forward_length"), block_auto_adjust_ff_dim=False,  # the GGUF's is final
                block_multiple_of=256, block_ffn_dim_multiplier=1.0, rope_theta=get("rope.freq_base", 1_000_000.0),
                full_attn_idxs=attn, tie_word_embeddings=True)


_RECURRENT_CONFIGS = {"mamba2": _mamba2_config, "lfm2": _lfm2_config, "qwen35": qwen35.config}
_SKIP = {"qwen35": qwen35.skip}  # tensors the mlx-lm model has no place for (the MTP block)


def mlx_name(gguf_name: str, arch: str) -> str:
    """blk.3.attn_q.weight → model.layers.3.self_attn.q_proj.weight (ModelLoadError if unknown)."""
    block = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if block:
        at, rest = f"{_LAYERS.get(arch, 'model.layers')}.{block[1]}", block[2]
        if rest in _LAYER_PARAMS.get(arch, {}):
            return f"{at}.{_LAYER_PARAMS[arch][rest]}"
        piece, _, suffix = rest.rpartition(".")
        if piece in _ARCH_LAYER_NAMES[arch]:
            return f"{at}.{_ARCH_LAYER_NAMES[arch][piece]}.{suffix}"
    else:
        stem, _, suffix = gguf_name.rpartition(".")
        names = _ARCH_GLOBAL_NAMES.get(arch, _GLOBAL_NAMES)
        if stem in names:
            return f"{names[stem]}.{suffix}"
    raise ModelLoadError(f"cannot convert: unknown {arch} tensor {gguf_name!r}")


# Tensors whose layout or value differs between llama.cpp and mlx-lm (kept float32): inverses of
# convert_hf_to_gguf's transforms, by (arch, name after "blk.N.")
_LAYOUTS: dict[tuple[str, str], Callable[[np.ndarray], np.ndarray]] = {
    ("mamba2", "ssm_a"): lambda a: np.log(-a).reshape(-1),  # ssm_a = −exp(A_log), (n_head, 1)
    ("mamba2", "ssm_d"): lambda d: d.reshape(-1),  # (n_head, 1)
    ("mamba2", "ssm_norm.weight"): lambda w: w.reshape(-1),  # (n_group, d_inner / n_group)
    ("mamba2", "ssm_conv1d.weight"): lambda w: w[..., None],  # (channels, kernel) → Conv1d's (.., .., 1)
    ("lfm2", "shortconv.conv.weight"): lambda w: w[..., None],
}


def _layout(f: GGUFFile, arch: str, gguf_name: str) -> Callable[[np.ndarray], np.ndarray] | None:
    if arch == "qwen35":
        return qwen35.layout(f, gguf_name)
    if arch == "gemma3" and gguf_name.endswith("norm.weight"):
        return lambda w: w - 1.0  # see the module docstring
    return _LAYOUTS.get((arch, gguf_name.split(".", 2)[-1]))


# Block formats whose 32-value groups are exactly MLX affine groups (value = scale·q + bias):
# type → (bytes per block, bits per value). Others are dequantized and re-quantized.
_AFFINE = {"Q4_0": (18, 4), "Q4_1": (20, 4), "Q8_0": (34, 8), "Q5_0": (22, 5), "Q5_1": (24, 5),
           "Q4_K": (144, 4), "Q5_K": (176, 5)}
_OFFSET = {"Q4_0": 8, "Q5_0": 16, "Q8_0": 128}  # x = d·(q − offset)


def _group_scale_bias(blocks: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """Per 32-value group of each block: (scale, bias) as float32, each (n_blocks, groups per block).

    Q4_0 / Q5_0 / Q8_0: x = d·(q − offset) (q stored signed in Q8_0); Q4_1 / Q5_1: x = d·q + m;
    Q4_K / Q5_K: 8 sub-blocks with 6-bit (sc, m) pairs, x = d·sc·q − dmin·m.
    """
    from gguf.quants import Q4_K

    f16 = lambda a, b: blocks[:, a:b].copy().view(np.float16).astype(np.float32)  # noqa: E731
    d = f16(0, 2)
    if kind in _OFFSET:
        return d, -float(_OFFSET[kind]) * d
    if kind in ("Q4_1", "Q5_1"):
        return d, f16(2, 4)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())  # Q5_K packs its scales like Q4_K
    return d * sc.astype(np.float32), -(f16(2, 4) * m.astype(np.float32))


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned ints < 2**bits, (rows, cols) with cols % 32 == 0 → MLX's packing: one little-endian
    bit stream per row (value i in bits [i·bits, (i+1)·bits)), as uint32 words (rows, cols·bits/32)."""
    stream = (q[..., None].astype(np.uint32) >> np.arange(bits, dtype=np.uint32)) & np.uint32(1)
    packed = np.packbits(stream.astype(np.uint8).reshape(q.shape[0], -1), axis=1, bitorder="little")
    return packed.view("<u4")


def affine_from_blocks(blocks: np.ndarray, kind: str, n_rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF blocks (n_blocks, block bytes) of a (n_rows, n_cols) matrix → MLX affine group-32 arrays,
    exact: every group of the format already is scale·q + bias with integer q < 2**bits.

    Returns:
        (packed uint32 (n_rows, n_cols·bits/32), scales float32 (n_rows, n_cols/32), biases (same)).
    """
    from gguf.quants import dequantize

    qtype = getattr(__import__("gguf").GGMLQuantizationType, kind)
    bits = _AFFINE[kind][1]
    x = dequantize(blocks, qtype).reshape(len(blocks), -1, GROUP)  # (n_blocks, groups, 32)
    scale, bias = _group_scale_bias(blocks, kind)
    safe = np.where(scale == 0, 1.0, scale)[..., None]
    q = np.clip(np.rint((x - bias[..., None]) / safe), 0, 2**bits - 1).astype(np.uint32)
    return pack_bits(q.reshape(n_rows, -1), bits), scale.reshape(n_rows, -1), bias.reshape(n_rows, -1)


def _tensor_arrays(f: GGUFFile, arch: str, bits: int) -> tuple[dict[str, Any], dict[str, str]]:
    """mlx name → mx.array (quantized tensors as weight/scales/biases), and how each was converted."""
    mx = _mx()
    types = {tname: qtype.name for tname, (qtype, _shape, _raw) in f.tensors.items()}
    native = mx.load(str(f.path)) if set(types.values()) <= _NATIVE | _FLOAT else {}
    out: dict[str, Any] = {}
    how: dict[str, str] = {}
    for tname, (_qtype, shape, raw) in f.tensors.items():  # shape: numpy order (rows..., columns)
        if arch in _SKIP and _SKIP[arch](f, tname):
            continue
        name, kind = mlx_name(tname, arch), types[tname]
        base = name.rpartition(".")[0]
        n_rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        layout = _layout(f, arch, tname)
        if layout is not None:
            out[name] = mx.array(layout(f.tensor(tname)).astype(np.float32))
            how[name] = "float32" if kind in _FLOAT else f"{kind.lower()} → float32"
        elif kind in _NATIVE and native:
            stem = tname.rpartition(".")[0]
            out[name] = native[tname]
            out[base + ".scales"] = native[stem + ".scales"].astype(mx.float32)
            out[base + ".biases"] = native[stem + ".biases"].astype(mx.float32)
            how[name] = f"{kind.lower()} native ({32 * native[tname].shape[-1] // int(shape[-1])}-bit)"
        elif kind in _AFFINE:
            blocks = raw.reshape(-1, _AFFINE[kind][0])
            w, s, b = affine_from_blocks(blocks, kind, n_rows)
            out[name], out[base + ".scales"], out[base + ".biases"] = mx.array(w), mx.array(s), mx.array(b)
            how[name] = f"{kind.lower()} → {_AFFINE[kind][1]}-bit (exact)"
        else:
            x = f.tensor(tname)
            if kind in _FLOAT or x.ndim == 1:
                out[name] = mx.array(x)
                how[name] = "float32" if kind in _FLOAT else f"{kind.lower()} → float32"
            else:
                out[name], out[base + ".scales"], out[base + ".biases"] = mx.quantize(
                    mx.array(x), group_size=GROUP, bits=bits)
                how[name] = f"{kind.lower()} → re-quantized {bits}-bit"
    return out, how


def _write_tokenizer(f: GGUFFile, dst: Path) -> None:
    """A GGUF with every metadata key of the source and no tensors (what a vocab-only load needs)."""
    import gguf

    w = gguf.GGUFWriter(dst, f.value("general.architecture"))
    add_fields(w, {k: v for k, v in f.kv.items() if k != "general.architecture"})
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


def convert_gguf(src: str | os.PathLike, out_dir: str | os.PathLike, *, bits: int = 8,
                 note: Callable[[str], None] | None = None) -> Conversion:
    """Convert a llama, gemma3, mamba2, lfm2 or qwen35 GGUF file into an MLX model directory.

    Args:
        src: the GGUF file.
        out_dir: the directory to write (created; must not hold a model already).
        bits: width for quantized types MLX cannot hold as they are (Q6_K, Q2_K, ...): 4 or 8.
        note: called with progress lines.

    Returns:
        A Conversion naming how every tensor was carried over.
    """
    from edgespec.backends.llama_cpp import check_gguf_file

    say = note or (lambda _line: None)
    src, out = Path(src).expanduser(), Path(out_dir).expanduser()
    check_gguf_file(src)
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8 (got {bits})")
    if (out / "config.json").exists():
        raise ModelLoadError(f"{out} already holds a model (config.json): choose an empty directory")
    say(f"reading {src.name}")
    try:
        f = read_gguf(src)
        config = mlx_config(f)
    except ValueError as e:  # truncated, corrupt, or a missing hyperparameter
        raise ModelLoadError(f"cannot convert {e}") from None
    arch = f.value("general.architecture")
    weights, how = _tensor_arrays(f, arch, bits)
    quantized = {k[:-len(".scales")]: weights[k[:-len(".scales")] + ".weight"] for k in weights if k.endswith(".scales")}
    if quantized:  # a default, and every quantized module's own width (mlx-lm's per-layer entries)
        config["quantization"] = {"group_size": GROUP, "bits": 4, **{
            module: {"group_size": GROUP, "bits": 32 * w.shape[-1] // (weights[module + ".scales"].shape[-1] * GROUP)}
            for module, w in quantized.items()}}
    conv = Conversion(out, arch, {k: v for k, v in how.items()})
    out.mkdir(parents=True, exist_ok=True)
    _mx().save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    _write_tokenizer(f, out / TOKENIZER_FILE)
    (out / REPORT_FILE).write_text(json.dumps(
        {"source": str(src), "converter_version": CONVERTER_VERSION, "tensors": conv.treatment}, indent=1) + "\n")
    say(f"wrote {out}: {conv.summary()}")
    if conv.requantized:
        say(f"note: {len(conv.requantized)} tensors were re-quantized to {bits} bits "
            f"(types MLX cannot hold as they are), e.g. {conv.requantized[0]}")
    return conv


def cached_conversion(src: str | os.PathLike, note: Callable[[str], None] | None = None) -> Path:
    """The MLX directory for a GGUF file under $EDGESPEC_HOME/mlx, converting it the first time."""
    from edgespec.models import edgespec_home, model_key

    src = Path(src).expanduser()
    key = model_key(src)[:16]
    final = edgespec_home() / "mlx" / f"{src.stem}-{key}-v{CONVERTER_VERSION}"
    if (final / "config.json").exists():
        return final
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        (note or (lambda _line: None))(f"converting {src.name} to MLX once (cached in {final})")
        convert_gguf(src, tmp, note=note)
        if not final.exists():
            os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
