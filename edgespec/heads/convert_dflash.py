"""Published DFlash v1 checkpoints (z-lab) → edgespec's DFlash head (llama.cpp's dflash GGUF layout).

Read from the upstream code (facts only; no code carried over): z-lab/dflash ``dflash/model.py``
(commit 44947fbf71114e241c96de194f4b382b5dd330d0). ``DFlashDraftModel`` (a Qwen3PreTrainedModel,
tensors without a ``model.`` prefix): ``fc`` (T·H → H, no bias) then ``hidden_norm`` over the fused
target features; ``layers.N`` = Qwen3 decoder layers whose attention (``Qwen3DFlashAttention``,
non-causal) takes K/V of both the context (``k_proj``/``v_proj`` of the normed fc output, no
``input_layernorm``) and the block, with per-head ``q_norm``/``k_norm`` and NeoX RoPE (HF
rotate-half, so no row permutation); ``norm``. The block's input embeddings and its LM head are the
target's (``target.model.embed_tokens`` / ``target.lm_head``), so the checkpoint has neither.
Config: ``dflash_config.{mask_token_id, target_layer_ids}``, ``block_size`` (top level; llama.cpp
also reads ``dflash_config.block_size``, default 16), and without ``target_layer_ids`` z-lab's
``build_target_layer_ids(num_target_layers, num_hidden_layers)``. ``extract_context_feature``
takes ``hidden_states[id + 1]``, the OUTPUT of layer id = the INPUT of layer id+1: edgespec's and
llama.cpp's ``dflash.target_layers`` store id + 1 (vendored llama.cpp of llama-cpp-python 0.3.36,
``conversion/qwen.py`` DFlashModel, which also maps ``hidden_norm`` → enc.output_norm and reads
``is_causal`` / ``dflash_config.causal``).

Optional tensors some exports carry: ``embed_tokens`` (dropped when it is a copy of the target's),
``lm_head`` with ``d2t`` offsets (EAGLE's convention: draft id i is target id i + d2t[i]) for a
draft vocabulary. DFlash2 (conv kernels, candidate selector), sliding windows, RoPE scaling and
attention biases are refused with a one-line error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy.typing as npt

from edgespec.heads import hf_checkpoint as hf
from edgespec.heads.dflash import DFlashConfig
from edgespec.heads.hf_checkpoint import Checkpoint, CheckpointError, TargetInfo

ARCHITECTURES = {"DFlashDraftModel": "z-lab DFlash"}
REFUSED = {"DFlash2DraftModel": "DFlash2 (conv kernels, candidate selector)",
           "DSparkDraftModel": "DSpark", "Qwen3DSparkModel": "DSpark", "DSparkSpeculator": "DSpark"}
_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GLOBAL = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight", "norm.weight": "output_norm.weight",
           "embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight", "d2t": "d2t"}
_DROPPED = ("t2d",)


def dflash_layout(config: dict[str, Any]) -> str | None:
    """"z-lab DFlash" for a DFlash v1 config.json, None for anything else; CheckpointError for a
    DFlash-family model edgespec does not convert (DFlash2, DSpark checkpoints)."""
    arch = (config.get("architectures") or [None])[0]
    if arch in REFUSED or "conv_kernel_size" in (config.get("dflash_config") or {}):
        raise CheckpointError(f"{REFUSED.get(arch, 'DFlash2 (conv kernels, candidate selector)')} checkpoints "
                              f"({arch}) are not supported: edgespec converts DFlash v1 (DFlashDraftModel)")
    return ARCHITECTURES.get(arch)


def z_lab_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default target layers (output ids) when dflash_config has none: the middle layer for
    one draft layer, else evenly spaced from 1 to N−3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 3 - 1
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _refuse_unsupported(ckpt: Checkpoint, c: dict[str, Any]) -> None:
    where = f"{ckpt.path} (DFlash)"
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise CheckpointError(f"{where} has attention/MLP biases, which llama.cpp's dflash graph lacks")
    if c.get("use_sliding_window") or (c.get("dflash_config") or {}).get("use_swa") or \
            "sliding_attention" in (c.get("layer_types") or []):
        raise CheckpointError(f"{where} uses sliding-window attention, which edgespec's DFlash head does not implement")
    if c.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where} has hidden_act={c['hidden_act']!r}; edgespec's DFlash head implements silu")
    hf.check_plain_rope(ckpt, c, "DFlash")
    if not c.get("rope_is_neox_style", True):
        raise CheckpointError(f"{where} uses interleaved RoPE (rope_is_neox_style false); DFlash v1 is NeoX")


def _gguf_names(ckpt: Checkpoint, n_layer: int) -> dict[str, str]:
    out, unknown = {}, []
    for name in ckpt.refs:
        stem = name.removeprefix("model.")
        parts = stem.split(".", 2)
        if parts[0] == "layers" and len(parts) == 3 and parts[1].isdigit() and int(parts[1]) < n_layer \
                and parts[2].endswith(".weight") and parts[2][:-len(".weight")] in _LAYER:
            out[f"blk.{parts[1]}.{_LAYER[parts[2][:-len('.weight')]]}.weight"] = name
        elif stem in _GLOBAL:
            out[_GLOBAL[stem]] = name
        elif stem not in _DROPPED:
            unknown.append(name)
    if unknown:
        raise CheckpointError(f"{ckpt.path} has tensors a DFlash v1 head does not have: {', '.join(sorted(unknown))}")
    return out


def convert_dflash(ckpt: Checkpoint, target: TargetInfo,
                   note: Callable[[str], None] | None = None,
                   ) -> tuple[DFlashConfig, dict[str, npt.NDArray[Any]]]:
    """The DFlashConfig and GGUF-named tensors of a z-lab DFlash v1 checkpoint, checked against ``target``.

    Args:
        ckpt: the checkpoint (``hf_checkpoint.read_checkpoint``).
        target: the target GGUF's header.
        note: called with lines worth telling the user (e.g. a dropped embed_tokens copy).

    Returns:
        (config, tensors): float32 weights (``d2t`` absolute int64 ids when the head has its own
        smaller LM head); ``config.target_layers`` are HF's ``target_layer_ids`` + 1.

    Raises:
        CheckpointError (one line) for an unsupported part, a size that does not fit the target
        (hidden size, vocabulary, layer ids), or a missing, unexpected or misshapen tensor.
    """
    say = note or (lambda _line: None)
    c, dc = ckpt.config, ckpt.config.get("dflash_config") or {}
    _refuse_unsupported(ckpt, c)
    H, n_head, n_vocab, n_ff = hf.core_sizes(ckpt, c, target)
    n_layer = int(c.get("num_hidden_layers", 1))
    if H != target.n_embd:
        raise CheckpointError(f"{ckpt.path} has hidden size {H}, but target {target.path} has hidden size "
                              f"{target.n_embd} (DFlash needs them equal)")
    if dc.get("mask_token_id") is None:
        raise CheckpointError(f"{ckpt.path}/config.json lacks dflash_config.mask_token_id (the block's MASK token)")
    n_tgt = c.get("num_target_layers")
    if n_tgt is not None and int(n_tgt) != target.n_layer:
        raise CheckpointError(f"{ckpt.path} was made for a target of {n_tgt} layers, but target {target.path} has "
                              f"{target.n_layer}")
    hf_ids = dc.get("target_layer_ids") or z_lab_target_layer_ids(target.n_layer, n_layer)
    layers = tuple(int(i) + 1 for i in hf_ids)
    if not all(1 <= lid < target.n_layer for lid in layers):
        raise CheckpointError(f"{ckpt.path} reads the outputs of target layers {list(hf_ids)}, but target "
                              f"{target.path} has {target.n_layer} layers (ids 0..{target.n_layer - 2} can be read)")
    names = _gguf_names(ckpt, n_layer)
    need = ["fc.weight", "enc.output_norm.weight", "output_norm.weight",
            *(f"blk.{i}.{g}.weight" for i in range(n_layer) for g in _LAYER.values())]
    missing = [n for n in need if n not in names]
    if missing:
        raise CheckpointError(f"{ckpt.path} lacks DFlash tensors: {', '.join(missing[:4])}"
                              f"{' …' if len(missing) > 4 else ''}")
    n_draft = ckpt.shape(names["output.weight"])[0] if "output.weight" in names else n_vocab
    n_head_kv = int(c.get("num_key_value_heads") or n_head)
    config = DFlashConfig(
        n_embd=H, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff,
        target_layers=layers, n_vocab=n_vocab, n_draft_vocab=n_draft, mask_token_id=int(dc["mask_token_id"]),
        block_size=int(dc.get("block_size", c.get("block_size", 16))), head_dim=int(c.get("head_dim") or H // n_head),
        rms_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_base=hf.rope_theta(c, 1000000.0),
        context_length=int(c.get("max_position_embeddings", 4096)),
        causal=bool(c.get("is_causal", dc.get("causal", False))))
    tensors = {g: ckpt.array(n) for g, n in names.items()}
    if "d2t" in tensors:
        del tensors["d2t"]
        d2t = hf.absolute_d2t(ckpt, names["d2t"], n_draft, n_vocab)
        if n_draft < n_vocab:
            tensors["d2t"] = d2t
    elif n_draft < n_vocab:
        raise CheckpointError(f"{ckpt.path}: lm_head drafts {n_draft} of {n_vocab} tokens but there is no d2t")
    hf.drop_target_copy(tensors, names.get("token_embd.weight", ""), target, say)
    if "token_embd.weight" in tensors and "output.weight" not in tensors:
        raise CheckpointError(f"{ckpt.path} has its own embed_tokens but no lm_head: llama.cpp would tie its LM head "
                              "to those embeddings, while DFlash uses the target's")
    shapes = config.shapes(own_embd="token_embd.weight" in tensors, own_output="output.weight" in tensors)
    hf.check_shapes(ckpt, tensors, shapes, names)
    return config, tensors
