"""Published EAGLE-3 checkpoints → edgespec's EAGLE-3 head (llama.cpp's eagle3 GGUF layout).

Three layouts, read from the upstream code (facts only; no code carried over):

* EAGLE (SafeAILab/EAGLE ``eagle/traineagle3/cnets.py`` at commit
  09fe6a050421cc4dfb1e3f4dfbe4f65aa9b9f63c, ``eagle/traineagle3/config.json`` at 9666a8182d9b):
  ``Model`` holds ``fc`` (3H → H, no bias),
  ``midlayer`` = ``LlamaDecoderLayeremb`` (``input_layernorm`` on the token embedding,
  ``hidden_norm`` on g, ``self_attn.{q,k,v}_proj`` over the 2H concatenation, ``o_proj``, residual
  = the un-normed g, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``), ``norm``,
  ``lm_head`` (V_d rows), ``embed_tokens`` and the buffers ``d2t`` (offsets: draft id i is target id
  i + d2t[i]) and ``t2d`` (a V-long mask). Its config is a ``LlamaForCausalLM`` with
  ``draft_vocab_size`` and one layer; its RoPE is HF's rotate-half with base 10000.
* SpecForge (sgl-project/SpecForge ``specforge/modeling/draft/llama3_eagle.py``
  ``LlamaForCausalLMEagle3``, commit a6b6b0230009d15ec2a97a57384e6f53f0f96946): the same tensor
  names; adds ``target_hidden_size`` (fc is 3·H_t → H), ``head_dim``, ``rope_theta``, and two
  options llama.cpp's graph lacks: ``fc_norm`` (a norm per feature chunk) and ``norm_output: false``
  (no norm before lm_head). Both are refused.
* speculators (vllm-project/speculators ``src/speculators/models/eagle3/{config,core,
  model_definitions}.py``, commit c05b95b303f7d4f21e8d7624e0ffa1c2d9b4d73b): ``Eagle3Speculator``
  with the decoder under ``layers.0.``, its hyperparameters in ``transformer_layer_config``, and
  ``eagle_aux_hidden_state_layer_ids``, ``norm_before_residual`` (the residual is the normed g),
  ``norm_before_fc`` (one RMSNorm ``input_norm`` over the 3·H_t features), ``fc_norm`` and
  ``norm_output`` (feeds the post-norm state back: refused, edgespec and llama.cpp feed the pre-norm
  h back). Only a llama decoder layer: the qwen3 one has Q/K norms the eagle3 graph lacks.

The target layers are those whose INPUT the head reads (EAGLE collects hidden states before layer
idx; vLLM's aux layers likewise): speculators' ids, else EAGLE's (2, N//2, N−3). That is what
``eagle3.target_layers`` stores, so no +1 (llama.cpp's conversion/llama.py does the same).

Conversion facts from llama.cpp (vendored in llama-cpp-python 0.3.36, ``conversion/llama.py``
LlamaModel with ``is_eagle3``): q_proj/k_proj rows are permuted from rotate-half pairs (i, i+d/2)
to ggml's adjacent pairs (2i, 2i+1) per head; d2t becomes absolute ids; t2d is dropped;
``hidden_norm`` → attn_norm_2; ``input_norm`` → enc.output_norm. Published heads have no fused-feature
norm: the GGUF says ``eagle3.norm_before_fc = false`` explicitly. llama3 RoPE scaling (Llama-3.1 heads'
``rope_scaling``, top level or in speculators' transformer_layer_config) becomes the F32 tensor
``rope_freqs.weight`` (n_rot/2 divisors of the inverse frequencies) and no key, as llama.cpp writes it
(generate_extra_tensors) and its eagle3 graph applies it (ggml_rope_ext's freq_factors); other
scaling types are refused. An ``embed_tokens`` that is a copy of the target's is dropped (the head
borrows the target's, as llama.cpp does without one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from edgespec.heads.eagle3 import BLK, Eagle3Config
from edgespec.heads.hf_checkpoint import (
    Checkpoint,
    CheckpointError,
    TargetInfo,
    absolute_d2t,
    check_plain_rope,
    check_shapes,
    core_sizes,
    drop_target_copy,
    llama3_rope_factors,
    rope_theta,
)

# config "architectures" → layout name (EAGLE's own config says LlamaForCausalLM: see eagle3_layout)
ARCHITECTURES = {"LlamaForCausalLMEagle3": "SpecForge", "Eagle3LlamaForCausalLM": "EAGLE",
                 "Eagle3DraftModel": "EAGLE", "Eagle3Speculator": "speculators"}
_LAYER = {"input_layernorm": "attn_norm", "hidden_norm": "attn_norm_2", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}
_GLOBAL = {"fc.weight": "fc.weight", "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight",
           "embed_tokens.weight": "token_embd.weight", "input_norm.weight": "enc.output_norm.weight"}
_DROPPED = ("t2d",)


def eagle3_layout(config: dict[str, Any]) -> str | None:
    """"EAGLE", "SpecForge" or "speculators" for an EAGLE-3 checkpoint's config.json, else None."""
    arch = (config.get("architectures") or [None])[0]
    if arch in ARCHITECTURES:
        return ARCHITECTURES[arch]
    if config.get("speculators_model_type") == "eagle3":
        return "speculators"
    if "draft_vocab_size" in config and config.get("num_hidden_layers") == 1:  # traineagle3/config.json
        return "EAGLE"
    return None


def permute_rope_rows(w: npt.NDArray[np.float32], n_head: int) -> npt.NDArray[np.float32]:
    """q/k_proj rows from HF's rotate-half order to ggml's interleaved pairs, per head (llama.cpp's
    LlamaModel.permute): row block (head, half, i) → (head, i, half)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hparams(ckpt: Checkpoint, layout: str) -> dict[str, Any]:
    """The decoder's hyperparameters with the EAGLE-3 fields, whatever the layout nests."""
    c = ckpt.config
    return {**c, **c["transformer_layer_config"]} if layout == "speculators" and "transformer_layer_config" in c else c


def _refuse_unsupported(ckpt: Checkpoint, hp: dict[str, Any], layout: str) -> None:
    where = f"{ckpt.path} ({layout} EAGLE-3)"
    if layout == "speculators" and hp.get("model_type", "llama") != "llama":
        raise CheckpointError(f"{where} has a {hp['model_type']!r} decoder layer; edgespec converts llama ones only "
                              "(llama.cpp's eagle3 graph has no Q/K norms)")
    if hp.get("num_hidden_layers", 1) != 1:
        raise CheckpointError(f"{where} has {hp['num_hidden_layers']} decoder layers; EAGLE-3 heads have one")
    if hp.get("fc_norm"):
        raise CheckpointError(f"{where} sets fc_norm (a norm per feature chunk), which llama.cpp's eagle3 graph lacks")
    if (layout == "speculators" and hp.get("norm_output")) or (layout == "SpecForge" and hp.get("norm_output") is False):
        raise CheckpointError(f"{where} sets norm_output={hp['norm_output']}: edgespec and llama.cpp norm h before "
                              "lm_head and feed the pre-norm h back, and nothing else")
    if hp.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where} has hidden_act={hp['hidden_act']!r}; EAGLE-3 heads use silu")


def _target_layers(ckpt: Checkpoint, hp: dict[str, Any], target: TargetInfo) -> tuple[int, ...]:
    n = target.n_layer
    ids = hp.get("eagle_aux_hidden_state_layer_ids") or [2, n // 2, n - 3]
    ids = tuple(int(i) for i in ids)
    if len(ids) != 3:
        raise CheckpointError(f"{ckpt.path}: eagle_aux_hidden_state_layer_ids {list(ids)} names {len(ids)} layers; "
                              "EAGLE-3 fuses exactly 3")
    if not all(1 <= i < n for i in ids):
        raise CheckpointError(f"{ckpt.path} reads target layers {ids}, but target {target.path} has {n} layers "
                              f"(ids 1..{n - 1} can be read)")
    return ids


def _gguf_names(ckpt: Checkpoint) -> dict[str, str]:
    """GGUF tensor name → checkpoint name; CheckpointError naming any tensor with no place."""
    out, unknown = {}, []
    for name in ckpt.refs:
        stem = name.removeprefix("model.")
        layer = next((p for p in ("midlayer.", "layers.0.") if stem.startswith(p)), None)
        if layer is not None and stem[len(layer):].endswith(".weight") and \
                stem[len(layer):-len(".weight")] in _LAYER:
            out[f"{BLK}{_LAYER[stem[len(layer):-len('.weight')]]}.weight"] = name
        elif stem in _GLOBAL:
            out[_GLOBAL[stem]] = name
        elif stem == "d2t":
            out["d2t"] = name
        elif stem not in _DROPPED:
            unknown.append(name)
    if unknown:
        raise CheckpointError(f"{ckpt.path} has tensors an EAGLE-3 head does not have: {', '.join(sorted(unknown))}")
    return out


def convert_eagle3(ckpt: Checkpoint, layout: str, target: TargetInfo,
                   note: Callable[[str], None] | None = None,
                   ) -> tuple[Eagle3Config, dict[str, npt.NDArray[Any]]]:
    """The Eagle3Config and GGUF-named tensors of an EAGLE-3 checkpoint, checked against ``target``.

    Args:
        ckpt: the checkpoint (``hf_checkpoint.read_checkpoint``).
        layout: its ``eagle3_layout``.
        target: the target GGUF's header.
        note: called with lines worth telling the user (e.g. a dropped embed_tokens copy).

    Returns:
        (config, tensors): float32 weights, ``d2t`` absolute int64 ids (absent when V_d = V).

    Raises:
        CheckpointError (one line) for an unsupported option, a size that does not fit the target
        (hidden size, vocabulary, layer ids), or a missing, unexpected or misshapen tensor.
    """
    say = note or (lambda _line: None)
    hp = _hparams(ckpt, layout)
    _refuse_unsupported(ckpt, hp, layout)
    rope = check_plain_rope(ckpt, hp, "EAGLE-3", scalings=("llama3",))
    names = _gguf_names(ckpt)
    H, n_head, n_vocab, n_ff = core_sizes(ckpt, hp, target)
    n_head_kv, head_dim = int(hp.get("num_key_value_heads") or n_head), int(hp.get("head_dim") or H // n_head)
    h_tgt = int(hp.get("target_hidden_size") or H)
    if h_tgt != target.n_embd:
        raise CheckpointError(f"{ckpt.path} was made for a target of hidden size {h_tgt}, but target {target.path} "
                              f"has hidden size {target.n_embd}")
    for need in ("fc.weight", "output.weight", *(f"{BLK}{g}.weight" for g in _LAYER.values()), "output_norm.weight"):
        if need not in names:
            raise CheckpointError(f"{ckpt.path} lacks the EAGLE-3 tensor for {need} "
                                  f"({_hf_name(need, layout)})")
    if ckpt.shape(names["fc.weight"])[-1] != 3 * target.n_embd:
        raise CheckpointError(f"{ckpt.path}: {names['fc.weight']} reads {ckpt.shape(names['fc.weight'])[-1]} features, "
                              f"but 3 layers of target {target.path} give {3 * target.n_embd}")
    norm_before_fc = bool(hp.get("norm_before_fc", False))
    if norm_before_fc != ("enc.output_norm.weight" in names):
        raise CheckpointError(f"{ckpt.path}: norm_before_fc is {norm_before_fc} but input_norm.weight is "
                              f"{'absent' if norm_before_fc else 'present'}")
    n_draft = ckpt.shape(names["output.weight"])[0]
    config = Eagle3Config(
        n_embd=H, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff, n_embd_tgt=h_tgt,
        target_layers=_target_layers(ckpt, hp, target), n_vocab=n_vocab, n_draft_vocab=n_draft, head_dim=head_dim,
        rms_eps=float(hp.get("rms_norm_eps", 1e-6)), rope_base=rope_theta(hp, 10000.0),
        context_length=int(hp.get("max_position_embeddings", 2048)),
        norm_before_residual=bool(hp.get("norm_before_residual", False)), norm_before_fc=norm_before_fc)
    tensors = {g: ckpt.array(n) for g, n in names.items() if g != "d2t"}
    tensors[BLK + "attn_q.weight"] = permute_rope_rows(tensors[BLK + "attn_q.weight"], n_head)
    tensors[BLK + "attn_k.weight"] = permute_rope_rows(tensors[BLK + "attn_k.weight"], n_head_kv)
    _vocab_map(ckpt, names, config, tensors)
    if rope.get("rope_type", rope.get("type")) == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_factors(ckpt, rope, config.rope_base, config.n_rot)
    drop_target_copy(tensors, names.get("token_embd.weight", ""), target, say)
    if "token_embd.weight" not in tensors and H != target.n_embd:
        raise CheckpointError(f"{ckpt.path} has no embed_tokens and hidden size {H}: it can borrow the target's "
                              f"embeddings only if that equals the target's {target.n_embd}")
    check_shapes(ckpt, tensors, config.shapes(own_embd="token_embd.weight" in tensors,
                                              rope_freqs="rope_freqs.weight" in tensors), names)
    return config, tensors


def _vocab_map(ckpt: Checkpoint, names: dict[str, str], config: Eagle3Config,
               tensors: dict[str, npt.NDArray[Any]]) -> None:
    """Put the absolute d2t into ``tensors`` when V_d < V (EAGLE stores offsets: id = i + d2t[i])."""
    V, Vd = config.n_vocab, config.n_draft_vocab
    if "d2t" not in names:
        if Vd < V:
            raise CheckpointError(f"{ckpt.path} drafts {Vd} of {V} tokens but has no d2t to map them")
        return
    d2t = absolute_d2t(ckpt, names["d2t"], Vd, V)
    if Vd < V:
        tensors["d2t"] = d2t
    elif np.any(d2t != np.arange(V)):
        raise CheckpointError(f"{ckpt.path}: d2t permutes a full vocabulary ({Vd} of {V}), which the eagle3 layout "
                              "cannot express")


def _hf_name(gguf_name: str, layout: str) -> str:
    """The checkpoint name a GGUF tensor comes from, for messages."""
    prefix = "layers.0." if layout == "speculators" else "midlayer."
    if gguf_name.startswith(BLK):
        part = gguf_name[len(BLK):-len(".weight")]
        return prefix + next(k for k, v in _LAYER.items() if v == part) + ".weight"
    return next(k for k, v in _GLOBAL.items() if v == gguf_name)
