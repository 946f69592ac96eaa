"""GGUF → MLX for Qwen3.5 dense (llama.cpp arch ``qwen35``): the parts mlx_convert.py looks up per architecture.

The target is mlx-lm 0.32.2's ``qwen3_5`` model (Gated-DeltaNet layers beside gated full attention). This
inverts llama.cpp's converter (llama-cpp-python 0.3.36, vendor/llama.cpp/conversion/qwen.py:
``Qwen3NextModel.modify_tensors`` and ``_LinearAttentionVReorderBase.modify_tensors``):
- ``ssm_a`` = −exp(A_log) becomes A_log again; ``ssm_dt.bias`` is ``dt_bias``; the depthwise conv kernel,
  squeezed to (channels, kernel), gets back the (channels, kernel, 1) layout mlx-lm's ``sanitize`` would
  make (so mlx-lm adds no +1 to the norms: llama.cpp already stored Qwen's zero-centred norms + 1,
  which is what mlx-lm's plain RMSNorm multiplies by; the gated ``ssm_norm`` has no +1 on either side);
- when there are more value heads than key heads, llama.cpp regroups the value heads from HF's
  grouped order [k head, v per k] to its tiled order [v per k, k head] (the V rows of ``attn_qkv`` and
  of the conv kernel, ``attn_gate``, ``ssm_alpha`` / ``ssm_beta``, ``ssm_a``, ``ssm_dt`` rows, and the
  columns of ``ssm_out``): regrouped back here. These tensors stay float32 (a quantized one is
  dequantized; column moves would break its blocks).
- the MTP ("nextn") block, ``blk.{n_layer}.*``, is not part of mlx-lm's model: it is left out here and
  read from the GGUF itself by the MTP drafter (heads/mtp_mlx.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from edgespec.errors import ModelLoadError

_ATTN = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
LAYER_NAMES = {**_ATTN, "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
               "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
               "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
               "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj"}
PARAMS = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}  # whole names after blk.N.


def n_trunk(f: Any) -> int:
    """Blocks of the model proper (block_count counts the nextn blocks too)."""
    return int(f.arch_value("block_count")) - int(f.value("qwen35.nextn_predict_layers", 0) or 0)


def config(f: Any, n_vocab: int) -> dict[str, Any]:
    """mlx-lm ``qwen3_5`` config.json from a qwen35 GGUF's metadata (ModelLoadError naming what does not fit)."""
    get = f.arch_value
    n_layer, interval = n_trunk(f), int(get("full_attention_interval", 4))
    recurrent = f.value("qwen35.attention.recurrent_layers")
    if recurrent is not None and [bool(r) for r in list(recurrent)[:n_layer]] != [
            (i + 1) % interval != 0 for i in range(n_layer)]:
        raise ModelLoadError("cannot convert this qwen35 GGUF to MLX: its recurrent layers are not every "
                             f"layer but each {interval}th (mlx-lm's qwen3_5 places them by full_attention_interval)")
    kv = get("attention.head_count_kv")
    kv = {int(k) for k in kv if int(k) > 0} if isinstance(kv, (list, tuple)) else {int(kv)}
    if len(kv) != 1:
        raise ModelLoadError(f"cannot convert this qwen35 GGUF to MLX: attention layers differ in head_count_kv {kv}")
    hd, nv = int(get("attention.key_length")), int(get("ssm.time_step_rank"))
    sections = list(f.value("qwen35.rope.dimension_sections", [11, 11, 10, 0]))[:3]
    return dict(model_type="qwen3_5", vocab_size=n_vocab, hidden_size=get("embedding_length"),
                intermediate_size=get("feed_forward_length"), num_hidden_layers=n_layer,
                num_attention_heads=get("attention.head_count"), num_key_value_heads=kv.pop(), head_dim=hd,
                rms_norm_eps=get("attention.layer_norm_rms_epsilon"), max_position_embeddings=get("context_length"),
                linear_num_value_heads=nv, linear_num_key_heads=get("ssm.group_count"),
                linear_key_head_dim=get("ssm.state_size"), linear_value_head_dim=int(get("ssm.inner_size")) // nv,
                linear_conv_kernel_dim=get("ssm.conv_kernel"), full_attention_interval=interval,
                tie_word_embeddings="output.weight" not in f.tensors,
                rope_parameters=dict(type="default", rope_theta=get("rope.freq_base"), mrope_section=sections,
                                     partial_rotary_factor=int(get("rope.dimension_count", hd)) / hd))


def skip(f: Any, gguf_name: str) -> bool:
    """The nextn block's tensors (blk.{n_layer}.* and later): not mlx-lm's."""
    parts = gguf_name.split(".")
    return parts[0] == "blk" and int(parts[1]) >= n_trunk(f)


def _regroup(x: np.ndarray, axis: int, nk: int, per: int, hd: int) -> np.ndarray:
    """llama.cpp's [per, nk, hd] value-head order along ``axis`` back to HF's [nk, per, hd]."""
    if per == 1:
        return x
    shape = list(x.shape)
    y = x.reshape(shape[:axis] + [per, nk, hd] + shape[axis + 1:])
    return np.swapaxes(y, axis, axis + 1).reshape(shape)


def layout(f: Any, gguf_name: str) -> Callable[[np.ndarray], np.ndarray] | None:
    """The inverse transform of one qwen35 tensor, or None where it is carried over as it is."""
    rest = gguf_name.split(".", 2)[-1]
    get = f.arch_value
    nk, nv = int(get("ssm.group_count")), int(get("ssm.time_step_rank"))
    dk, dv, per = int(get("ssm.state_size")), int(get("ssm.inner_size")) // nv, nv // nk
    qk = 2 * nk * dk

    def vsplit(w: np.ndarray) -> np.ndarray:  # q and k rows / channels as they are, v regrouped
        return np.concatenate([w[:qk], _regroup(w[qk:], 0, nk, per, dv)])

    return {
        "attn_qkv.weight": vsplit,
        "attn_gate.weight": lambda w: _regroup(w, 0, nk, per, dv),
        "ssm_beta.weight": lambda w: _regroup(w, 0, nk, per, 1),
        "ssm_alpha.weight": lambda w: _regroup(w, 0, nk, per, 1),
        "ssm_a": lambda a: _regroup(np.log(-a.reshape(-1)), 0, nk, per, 1),
        "ssm_dt.bias": lambda b: _regroup(b.reshape(-1), 0, nk, per, 1),
        "ssm_conv1d.weight": lambda w: vsplit(w.reshape(w.shape[0], -1))[..., None],
        "ssm_out.weight": lambda w: _regroup(w, 1, nk, per, dv),
    }.get(rest)
