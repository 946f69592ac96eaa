"""Published-head checkpoints for the converter tests, and independent torch ports of each layout's
reference forward.

The ports are written from the upstream code, not from edgespec's heads (tensor names and the
forward as the reference code has them: HF rotate-half RoPE, HF tensor layout, d2t offsets):
- ``eagle3_reference``: SafeAILab/EAGLE eagle/traineagle3/cnets.py (Model.forward, one step of
  LlamaDecoderLayeremb + LlamaAttention), SpecForge's llama3_eagle.py (``project_hidden_states``,
  ``compute_logits``) and speculators' model_definitions.py (``norm_before_residual``) and core.py
  (``input_norm`` when ``norm_before_fc``); llama3 RoPE scaling as transformers'
  ``_compute_llama3_parameters`` computes the inverse frequencies (SpecForge's LlamaRotaryEmbedding
  and speculators' transformers rotary embedding apply that function's formula);
- ``dflash_reference``: z-lab/dflash dflash/model.py (DFlashDraftModel.forward with
  Qwen3DFlashAttention, non-causal, context K/V from ``hidden_norm(fc(target_hidden))``).
Both run in float64 over the whole sequence at once (causal mask / full context), the way the
training code does, so that a head run position by position with a KV cache must agree with them.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def save_checkpoint(d: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], shards: int = 1) -> Path:
    """Write config.json and the tensors as safetensors (``shards`` > 1: with an index)."""
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config, indent=1))
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n].contiguous() for n in names}, str(d / "model.safetensors"))
        return d
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(d / fname))
        weight_map |= dict.fromkeys(part, fname)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def random_weights(shapes: dict[str, tuple[int, ...]], dtype: str, seed: int) -> dict[str, torch.Tensor]:
    """Matrices ~ N(0, 1/fan_in), norms 1 + 0.2·N(0, 1) (so a swapped norm shows), in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            t = 1.0 + 0.2 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) / math.sqrt(shape[1])
        out[name] = t.to(DTYPES[dtype])
    return out


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _llama3(inv_freq: torch.Tensor, rope: dict[str, Any]) -> torch.Tensor:
    """transformers' _compute_llama3_parameters (modeling_rope_utils.py) on default inverse frequencies."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _cos_sin(positions: torch.Tensor, dim: int, base: float,
             rope: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's rotate-half cos/sin; ``rope``: a config's rope_scaling / rope_parameters (llama3 or none)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    kind = (rope or {}).get("rope_type", (rope or {}).get("type", "default"))
    if kind == "llama3":
        inv_freq = _llama3(inv_freq, rope or {})
    elif kind != "default":
        raise NotImplementedError(f"the reference ports implement llama3 RoPE scaling only (got {kind!r})")
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _attention(q, k, v, mask, n_kv):  # q (heads, n, d), k/v (kv heads, m, d), mask (n, m) additive
    group = q.shape[0] // n_kv
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    w = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]) + mask, dim=-1)
    return (w @ v).transpose(0, 1).reshape(q.shape[1], -1)


def _mlp(x, w, p):
    return (torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)) \
        @ w[p + "mlp.down_proj.weight"].T


def eagle3_reference(w: dict[str, torch.Tensor], cfg: dict[str, Any], features: np.ndarray, tokens: list[int],
                     embed: np.ndarray, n_vocab: int) -> np.ndarray:
    """Target-vocabulary logits (n, V) (−inf outside the draft vocabulary) of one EAGLE-3 step over
    pairs (tokens[i], features[i]) at positions 0..n−1, causal (EAGLE's first TTT step).

    ``w``: the checkpoint's tensors (any of the three layouts), ``cfg``: its config.json, ``embed``:
    the token embeddings the head uses (its own embed_tokens, else the target's)."""
    w = {k: v.to(torch.float64) for k, v in w.items()}
    hp = {**cfg, **cfg.get("transformer_layer_config", {})}
    p = "layers.0." if "layers.0.hidden_norm.weight" in w else "midlayer."
    eps, n_head, n_kv = hp["rms_norm_eps"], hp["num_attention_heads"], hp["num_key_value_heads"]
    hd = hp.get("head_dim") or hp["hidden_size"] // n_head
    f = torch.as_tensor(features, dtype=torch.float64)
    if cfg.get("norm_before_fc"):
        f = _rms(f, w["input_norm.weight"], eps)
    g = f @ w["fc.weight"].T  # project_hidden_states
    n = len(tokens)
    hidden = _rms(g, w[p + "hidden_norm.weight"], eps)
    residual = hidden if cfg.get("norm_before_residual") else g
    emb = _rms(torch.as_tensor(embed, dtype=torch.float64)[torch.as_tensor(tokens)], w[p + "input_layernorm.weight"], eps)
    x = torch.cat((emb, hidden), dim=-1)
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(n, n_head, hd).transpose(0, 1)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(n, n_kv, hd).transpose(0, 1)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, n_kv, hd).transpose(0, 1)
    rope = hp.get("rope_parameters") or hp.get("rope_scaling") or {}  # transformers v5 / v4 names
    cos, sin = _cos_sin(torch.arange(n), hd, float(rope.get("rope_theta", hp.get("rope_theta", 10000.0))), rope)
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    mask = torch.triu(torch.full((n, n), float("-inf"), dtype=torch.float64), diagonal=1)
    h = residual + _attention(q, k, v, mask, n_kv) @ w[p + "self_attn.o_proj.weight"].T
    h = h + _mlp(_rms(h, w[p + "post_attention_layernorm.weight"], eps), w, p)
    logits_d = _rms(h, w["norm.weight"], eps) @ w["lm_head.weight"].T  # compute_logits (norm_output)
    n_draft = logits_d.shape[1]
    ids = torch.arange(n_draft) + (w["d2t"].to(torch.int64) if "d2t" in w else 0)  # d2t: offsets
    out = torch.full((n, n_vocab), float("-inf"), dtype=torch.float64)
    out[:, ids] = logits_d
    return out.numpy()


def dflash_reference(w: dict[str, torch.Tensor], cfg: dict[str, Any], context: np.ndarray, block: list[int],
                     embed: np.ndarray, lm_head: np.ndarray) -> np.ndarray:
    """Logits (b, V) of z-lab's DFlashDraftModel for a block after ``len(context)`` context positions
    (all context features given at once, as on the first call): noise = the target's embeddings of
    the block, K/V of context and block, positions 0..n+b−1, no mask; LM head = the target's."""
    w = {k.removeprefix("model."): v.to(torch.float64) for k, v in w.items()}
    eps, n_head, n_kv = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    th = _rms(torch.as_tensor(context, dtype=torch.float64) @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    x = torch.as_tensor(embed, dtype=torch.float64)[torch.as_tensor(block)]
    n, b = len(th), len(block)
    cos, sin = _cos_sin(torch.arange(n + b), hd, float(cfg.get("rope_theta", 1000000.0)))
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        u = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = _rms((u @ w[p + "self_attn.q_proj.weight"].T).view(b, n_head, hd), w[p + "self_attn.q_norm.weight"], eps)
        kv_in = torch.cat((th, u))
        k = _rms((kv_in @ w[p + "self_attn.k_proj.weight"].T).view(n + b, n_kv, hd), w[p + "self_attn.k_norm.weight"], eps)
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(n + b, n_kv, hd)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        q = q * cos[-b:] + _rotate_half(q) * sin[-b:]
        k = k * cos + _rotate_half(k) * sin
        x = x + _attention(q, k, v, torch.zeros(b, n + b, dtype=torch.float64), n_kv) @ w[p + "self_attn.o_proj.weight"].T
        x = x + _mlp(_rms(x, w[p + "post_attention_layernorm.weight"], eps), w, p)
    return (_rms(x, w["norm.weight"], eps) @ torch.as_tensor(lm_head, dtype=torch.float64).T).numpy()


def within_range(got: np.ndarray, ref: np.ndarray, rel: float = 1e-4) -> float:
    """Assert the same −inf pattern and finite entries within ``rel`` of the reference's logit range;
    returns the max difference relative to that range."""
    fin = np.isfinite(ref)
    assert np.array_equal(np.isfinite(got), fin)
    span = float(ref[fin].max() - ref[fin].min())
    diff = float(np.abs(got[fin] - ref[fin]).max()) / span
    assert diff <= rel, diff
    return diff


# -- edgespec's shipped heads, written back in a published layout (for `--drafter HEAD_DIR` tests) -----


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """ggml's interleaved RoPE rows back to HF's rotate-half order (inverse of llama.cpp's permute)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _exact(v: np.ndarray, name: str) -> torch.Tensor:
    """fp16 for the matrices the shipped heads store as F16, fp32 for norms and fc (kept F32)."""
    t = torch.from_numpy(np.ascontiguousarray(v))
    return t.to(torch.float16) if v.ndim == 2 and name != "fc.weight" else t


def export_eagle3_speculators(head_gguf: Path, out: Path) -> Path:
    """An EAGLE-3 head GGUF (norm_before_fc) as a speculators Eagle3Speculator checkpoint, for
    converting it back with `--drafter DIR` (matrices fp16, norms fp32: the GGUF's values exactly)."""
    from edgespec.heads.gguf_io import read_eagle3_gguf

    c, t = read_eagle3_gguf(head_gguf)
    names = {"attn_norm": "input_layernorm", "attn_norm_2": "hidden_norm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    w = {f"layers.0.{hf}.weight": t[f"blk.0.{g}.weight"] for g, hf in names.items()}
    w["layers.0.self_attn.q_proj.weight"] = _unpermute(w["layers.0.self_attn.q_proj.weight"], c.n_head)
    w["layers.0.self_attn.k_proj.weight"] = _unpermute(w["layers.0.self_attn.k_proj.weight"], c.n_head_kv)
    w |= {"fc.weight": t["fc.weight"], "norm.weight": t["output_norm.weight"], "lm_head.weight": t["output.weight"],
          "input_norm.weight": t["enc.output_norm.weight"]}
    tensors = {k: _exact(v, k) for k, v in w.items()}
    tensors["d2t"] = torch.from_numpy(t["d2t"] - np.arange(len(t["d2t"])))
    config = dict(architectures=["Eagle3Speculator"], speculators_model_type="eagle3", draft_vocab_size=c.n_draft_vocab,
                  norm_before_residual=c.norm_before_residual, norm_before_fc=True,
                  eagle_aux_hidden_state_layer_ids=list(c.target_layers),
                  transformer_layer_config=dict(model_type="llama", hidden_size=c.n_embd, num_attention_heads=c.n_head,
                                                num_key_value_heads=c.n_head_kv, head_dim=c.head_dim,
                                                intermediate_size=c.n_ff, num_hidden_layers=1, rms_norm_eps=c.rms_eps,
                                                rope_theta=c.rope_base, vocab_size=c.n_vocab, hidden_act="silu",
                                                max_position_embeddings=c.context_length))
    return save_checkpoint(out, config, tensors)


def export_dflash_zlab(head_gguf: Path, out: Path) -> Path:
    """A DFlash head GGUF as a z-lab DFlashDraftModel checkpoint (the GGUF's values exactly), with
    its own lm_head and d2t offsets if it has them."""
    from edgespec.heads.dflash_gguf import read_dflash_gguf

    c, t = read_dflash_gguf(head_gguf)
    names = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
             "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
             "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    w = {f"layers.{i}.{hf}.weight": t[f"blk.{i}.{g}.weight"] for i in range(c.n_layer) for g, hf in names.items()}
    w |= {"fc.weight": t["fc.weight"], "hidden_norm.weight": t["enc.output_norm.weight"],
          "norm.weight": t["output_norm.weight"]}
    if "output.weight" in t:
        w["lm_head.weight"] = t["output.weight"]
    tensors = {k: _exact(v, k) for k, v in w.items()}
    if "d2t" in t:
        tensors["d2t"] = torch.from_numpy(t["d2t"] - np.arange(len(t["d2t"])))
    config = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=c.n_embd,
                  num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.n_head_kv,
                  head_dim=c.head_dim, intermediate_size=c.n_ff, rms_norm_eps=c.rms_eps, rope_theta=c.rope_base,
                  rope_scaling=None, vocab_size=c.n_vocab, hidden_act="silu", attention_bias=False,
                  block_size=c.block_size, max_position_embeddings=c.context_length, use_sliding_window=False,
                  dflash_config=dict(mask_token_id=c.mask_token_id, target_layer_ids=[i - 1 for i in c.target_layers]))
    return save_checkpoint(out, config, tensors)


# -- llama.cpp's own converter (vendored in llama-cpp-python 0.3.36), for the cross-check ---------------

# `make converter` puts it there (`make test` does it first); EDGESPEC_LLAMA_CPP_SRC points elsewhere.
LLAMA_CPP_SRC = Path(os.environ.get("EDGESPEC_LLAMA_CPP_SRC", "~/.cache/edgespec/src/llama.cpp-0.3.36")).expanduser()

# The vocabulary is the target's and edgespec copies it from the target GGUF; llama.cpp would build
# it from the target's HF tokenizer files, which the fixture target directory does not have.
_LLAMA_CPP_RUNNER = """
import runpy, sys
src, head, target, out = sys.argv[1:5]
sys.path[:0] = [src, src + "/gguf-py"]
from conversion import llama, qwen
llama.LlamaModel.set_vocab = lambda self: None
qwen.DFlashModel.set_vocab = lambda self: self.gguf_writer.add_mask_token_id(
    self.hparams["dflash_config"]["mask_token_id"])
sys.argv = ["convert_hf_to_gguf.py", head, "--target-model-dir", target, "--outfile", out, "--outtype", "f32"]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def hf_target_dir(d: Path, n_layer: int, n_embd: int, n_vocab: int) -> Path:
    """A target directory as llama.cpp's converter reads it for a head: config.json only."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(dict(architectures=["LlamaForCausalLM"], model_type="llama",
                                                   hidden_size=n_embd, num_hidden_layers=n_layer, vocab_size=n_vocab)))
    return d


def llama_cpp_convert(head_dir: Path, target_dir: Path, out: Path) -> Path:
    """Convert a head checkpoint with the vendored convert_hf_to_gguf.py (F32), in a subprocess (it
    imports its own gguf-py); the test is skipped where the converter is not fetched."""
    import subprocess
    import sys

    import pytest

    if not (LLAMA_CPP_SRC / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"needs llama.cpp's converter in {LLAMA_CPP_SRC}: make converter LLAMA_CPP_SRC={LLAMA_CPP_SRC}")
    r = subprocess.run([sys.executable, "-c", _LLAMA_CPP_RUNNER, str(LLAMA_CPP_SRC), str(head_dir), str(target_dir),
                        str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out
