"""GGUF files for DFlash heads in llama.cpp's dflash layout (shares ``gguf_io``'s head-file writer).

Layout (vendored llama.cpp 0.3.36: src/models/dflash.cpp load_arch_hparams/load_arch_tensors,
src/llama-arch.cpp, conversion/qwen.py DFlashModel, common/speculative.cpp): architecture
``dflash``; the usual hyperparameters under ``dflash.*`` (context_length, embedding_length,
block_count, feed_forward_length, attention.head_count[_kv], attention.key_length/value_length,
attention.layer_norm_rms_epsilon, rope.freq_base, rope.dimension_count); DFlash keys
``dflash.target_layers`` (INT32 array, required: extract ids = HF target_layer_ids + 1, i.e. the
feature is the INPUT of that target layer), ``dflash.block_size`` (UINT32; speculative.cpp defaults
to 16 without it), ``dflash.attention.causal`` (BOOL, false = DFlash's non-causal block),
``tokenizer.ggml.mask_token_id`` (UINT32) and optional ``dflash.embedding_scale``,
``dflash.attention.scale``, ``dflash.attention.value_scale`` (FLOAT32, 0/absent = unset).
Tensors: ``fc.weight`` (ne {T·H, H}), ``enc.output_norm.weight`` (the hidden_norm after fc),
``blk.N.{attn_norm,attn_q,attn_k,attn_v,attn_output,attn_q_norm,attn_k_norm,ffn_norm,ffn_gate,
ffn_up,ffn_down}.weight``, ``output_norm.weight``, optional ``output.weight`` (V_d rows),
``token_embd.weight`` and ``d2t`` (I64). Without token_embd / output llama.cpp borrows the
target's through ``ctx_other``. The file carries the target's ``tokenizer.*`` metadata.

DSpark (``edgespec.heads.dspark``) adds ``markov_w1.weight`` (ne {R, V}), ``markov_w2.weight``
(ne {R, V_d}), optional ``conf_proj.weight`` (ne {H+R, 1}) and ``conf_proj.bias`` (ne {1}), and the
BOOL keys ``dflash.sample_from_anchor`` (llama.cpp's default when absent is true; edgespec writes
false, the bonus-anchor layout, and refuses true) and ``dflash.has_confidence_head``. ``markov_w2``
and the confidence head are written F32 whatever the weight type, and ``markov_w1`` (a row per
target token: 262k × R on Gemma-3) in ``markov_type``: Q8_0 by default (F16 if R is not a multiple
of 32), F32 in an F32 file. llama.cpp's in-graph Markov bias then matches the host's to float
rounding, which the libllama drafter relies on: ``ggml_get_rows`` dequantizes the rows it picks
exactly as ``gguf.quants`` dequantizes them for the host, and the product with the F32
``markov_w2`` keeps F32 activations.

The reader refuses files using parts ``edgespec.heads.dflash`` does not implement (DFlash2
conv/selector keys, DSV4 hyper-connections, sliding windows, M-RoPE sections, non-SiLU activations)
as well as any unknown tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy.typing as npt

from edgespec.gguf_file import read_gguf
from edgespec.heads.dflash import DFlashConfig
from edgespec.heads.dspark import MARKOV_TENSORS, MARKOV_W1
from edgespec.heads.gguf_io import WEIGHT_TYPES, finish_head_file, start_head_file

# fc reads the raw fused target features, whose outlier dimensions exceed float16's range on real
# targets (Gemma-3-270M: |x| up to ~1e5); ggml's CPU matmul converts the activations to the weight's
# vec-dot type, so an F16 fc turns them into inf and the block's logits into NaN. F32 fc keeps them.
# markov_w2 and the confidence head multiply the host's chain: F32 keeps that chain exact.
F32_TENSORS = ("fc.weight", *(t for t in MARKOV_TENSORS if t != MARKOV_W1))

ARCH = "dflash"
MASK_KEY = "tokenizer.ggml.mask_token_id"
_UNSUPPORTED_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                     "hyper_connection.count", "attention.sliding_window", "rope.dimension_sections")


def write_dflash_gguf(path: str | Path, config: DFlashConfig, tensors: Mapping[str, npt.NDArray[Any]], *,
                      vocab_source: str | Path, weight_type: str = "f16", name: str = "edgespec dflash head",
                      extra_kv: Mapping[str, str] | None = None, markov_type: str | None = None) -> Path:
    """Write a DFlash head in llama.cpp's layout.

    Args:
        path: output file.
        config: the head's hyperparameters.
        tensors: GGUF tensor name → array (numpy shape = reversed GGUF ne; ``d2t`` int64), as
            a head's tensors hold them.
        vocab_source: the target GGUF; its ``tokenizer.*`` metadata is copied and the config's
            ``mask_token_id`` overrides any mask id it has.
        weight_type: "f16", "q8_0" or "f32" for the 2-D weights; norms stay F32, d2t I64. A Q8_0
            matrix whose rows are not a multiple of 32 values is written as F16.
        name: general.name.
        extra_kv: extra string metadata (e.g. ``edgespec.head.*`` provenance).
        markov_type: "q8_0", "f16" or "f32" for a DSpark head's ``markov_w1`` (see the module doc);
            default "f32" for an F32 file, else "q8_0".

    Returns:
        ``path`` as a Path.
    """
    config.check_tensors(tensors)
    w, tok = start_head_file(path, ARCH, config, n_layer=config.n_layer, vocab_source=vocab_source,
                             weight_type=weight_type, name=name)
    tok.pop(MASK_KEY, None)  # the config's mask id replaces the target's
    w.add_uint32(f"{ARCH}.block_size", config.block_size)
    w.add_bool(f"{ARCH}.attention.causal", config.causal)
    w.add_string(f"{ARCH}.hidden_activation", "silu")
    for key, value in (("embedding_scale", config.embedding_scale), ("attention.scale", config.attention_scale),
                       ("attention.value_scale", config.value_scale)):
        if value:
            w.add_float32(f"{ARCH}.{key}", value)
    w.add_uint32(MASK_KEY, config.mask_token_id)
    if config.markov_rank:
        w.add_bool(f"{ARCH}.sample_from_anchor", config.sample_from_anchor)
        w.add_bool(f"{ARCH}.has_confidence_head", config.has_confidence)
    markov_type = markov_type or ("f32" if weight_type == "f32" else "q8_0")
    if markov_type not in WEIGHT_TYPES:
        raise ValueError(f"markov_type must be one of {', '.join(WEIGHT_TYPES)} (got {markov_type!r})")
    types = dict.fromkeys(F32_TENSORS, "f32") | {MARKOV_W1: markov_type}
    finish_head_file(w, tok, tensors, weight_type, extra_kv, types=types)
    return Path(path)


def read_dflash_gguf(path: str | Path) -> tuple[DFlashConfig, dict[str, npt.NDArray[Any]]]:
    """Read a DFlash head written in llama.cpp's layout: its config and its tensors (float32, d2t
    int64). Raises ValueError if the file is not a dflash GGUF or uses an unsupported part."""
    f = read_gguf(path, lambda k: not k.startswith("tokenizer.") or k in ("tokenizer.ggml.tokens", MASK_KEY))
    arch = f.value("general.architecture")
    if arch != ARCH:
        raise ValueError(f"{path} is not a DFlash head (general.architecture={arch!r})")
    for k in _UNSUPPORTED_KEYS:
        if f"{ARCH}.{k}" in f.kv:
            raise ValueError(f"{path} uses {ARCH}.{k}, which edgespec's DFlash reference does not implement")
    act = f.value(f"{ARCH}.hidden_activation", "silu")
    if act != "silu":
        raise ValueError(f"{path} has hidden_activation={act!r}; edgespec's DFlash reference implements silu only")
    key = f.arch_value
    mask = f.value(MASK_KEY)
    if mask is None:
        raise ValueError(f"{path} lacks {MASK_KEY} (the block's MASK token)")
    n_head = int(key("attention.head_count"))
    n_embd = int(key("embedding_length"))
    tensors = {name: f.tensor(name) for name in f.tensors}
    n_vocab = int(f.value(f"{ARCH}.vocab_size") or len(f.value("tokenizer.ggml.tokens", [])))
    markov = tensors.get("markov_w1.weight")
    rank = int(markov.shape[1]) if markov is not None and markov.ndim == 2 else 0
    if rank and key("sample_from_anchor", True):
        raise ValueError(f"{path} has {ARCH}.sample_from_anchor = true (llama.cpp's default when absent); "
                         "edgespec's DSpark implements the bonus-anchor layout (false) only")
    config = DFlashConfig(
        n_embd=n_embd, n_layer=int(key("block_count")), n_head=n_head,
        n_head_kv=int(key("attention.head_count_kv", n_head)), n_ff=int(key("feed_forward_length")),
        target_layers=tuple(int(x) for x in key("target_layers")), n_vocab=n_vocab,
        n_draft_vocab=len(tensors["d2t"]) if "d2t" in tensors else n_vocab, mask_token_id=int(mask),
        block_size=int(key("block_size", 16)), head_dim=int(key("attention.key_length", n_embd // n_head)),
        rms_eps=float(key("attention.layer_norm_rms_epsilon")), rope_base=float(key("rope.freq_base", 10000.0)),
        n_rot=int(key("rope.dimension_count", n_embd // n_head)), context_length=int(key("context_length")),
        causal=bool(key("attention.causal", False)), embedding_scale=float(key("embedding_scale", 0.0)),
        attention_scale=float(key("attention.scale", 0.0)), value_scale=float(key("attention.value_scale", 0.0)),
        markov_rank=rank, has_confidence=bool(key("has_confidence_head", "conf_proj.weight" in tensors)))
    config.check_tensors(tensors)
    return config, tensors
