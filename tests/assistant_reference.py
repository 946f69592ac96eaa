"""An independent torch (float64) port of the Gemma-4 assistant ("MTP assistant") forward and of the
Gemma-4 target forward it reads, from the HF layout.

Written from the upstream code, not from edgespec's llama.cpp wiring (drafters/assistant.py,
backends/llama_mtp.py):
- transformers 5.25 ``models/gemma4_assistant/modeling_gemma4_assistant.py``
  (``Gemma4AssistantForCausalLM.forward``): ``pre_projection(cat([target_embed(x), h]))``, where
  ``target_embed`` is the TARGET's ``Gemma4TextScaledWordEmbedding`` (its table × √hidden_size of the
  target) and h the target's last hidden state (``hidden_states[-1]``, which ``capture_outputs`` ties to
  the post-final-norm ``last_hidden_state``); then the assistant's own ``Gemma4TextModel`` on those
  input embeddings (no embedding scale of its own), every layer KV-shared (``num_kv_shared_layers ==
  num_hidden_layers``: only q_proj / q_norm / o_proj, the K/V being the target's ``shared_kv_states``
  of its last layer of the same type, already k-normed, v-normed and roped); the final ``norm``; logits
  = that × the assistant's tied ``embed_tokens`` (no final soft-capping: the assistant's forward applies
  none), and the next h = ``post_projection`` of it.
- transformers 5.25 ``models/gemma4/modeling_gemma4.py`` for the parts: ``Gemma4RMSNorm`` (``x̂ · w``,
  NOT zero-centred; v_norm without a weight), ``Gemma4TextAttention`` (q_norm / k_norm per head before
  RoPE, ``scaling = 1.0``), ``Gemma4TextDecoderLayer`` (sandwich norms: ``x + post_attn_norm(attn(
  input_norm(x)))``, ``x + post_ff_norm(mlp(pre_ff_norm(x)))``, then ``× layer_scalar``),
  ``Gemma4TextMLP`` (``gelu_pytorch_tanh``-gated), ``Gemma4TextRotaryEmbedding`` with per-layer-type
  parameters: "default" RoPE (θ 1e4) on sliding layers, and on full-attention layers
  ``modeling_rope_utils._compute_proportional_rope_parameters``: the first ``partial_rotary_factor ·
  head_dim / 2`` inverse frequencies ``θ^(-2i / head_dim)`` (over the FULL head size) and zeros after,
  i.e. NeoX pairs (i, i + head_dim/2) for i < that count, the rest passed through; full-attention
  layers use ``global_head_dim``; the target's final logit soft-capping when it has one.
- The pairing is the one shared by transformers' ``SinglePositionMultiTokenCandidateGenerator.get_candidates``
  (generation/candidate_generator.py, after the target's prefill) and llama.cpp's
  ``common_speculative`` MTP path with shared memory: with context c_0..c_{N-1} and the target having
  evaluated c_0..c_{N-2}, step 1 is (c_{N-1}, h_{N-2}) at position N-1, attending over the target's
  K/V of positions 0..N-2; step i+1 is (x̃ᵢ, the assistant's own next h) at the SAME position N-1
  (``position_ids`` is fixed before the draft loop).
- The sliding window: a key at position p is seen from position q when ``q - p < sliding_window``
  (the target's own causal rule, transformers' ``sliding_window_overlay``, and llama.cpp's
  ``LLAMA_SWA_TYPE_STANDARD``, which ``src/models/gemma4-assistant.cpp`` sets for the assistant: measured,
  libllama's assistant equals this rule and not a window a key wider or narrower).
  transformers' assistant differs at the window's edge: ``create_attention_masks`` takes a
  bidirectional sliding-window mask (``|q_idx - kv_idx| <= sliding_window``) flipped onto the LAST
  keys, so it reads the last ``sliding_window + 1`` keys it is given (distances 1..window+1, two more
  than llama.cpp's 1..window-1) when the target returned every position (no cache);
  ``window_extra=2`` reproduces that.

Whole sequences at once, float64, causal masks: a backend that runs with a KV cache must agree.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

T = torch.Tensor


def load_hf(hf_dir: str | Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, T]]:
    """(top config, text config, float64 state dict) of an HF Gemma-4 or Gemma-4 assistant checkpoint."""
    from safetensors.torch import load_file

    d = Path(hf_dir)
    top = json.loads((d / "config.json").read_text())
    text = top.get("text_config", top)
    sd: dict[str, T] = {}
    for f in sorted(d.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            sd[k.replace("model.language_model.", "model.")] = v.to(torch.float64)
    return top, text, sd


def _rms(x: T, w: T | None, eps: float) -> T:
    """Gemma4RMSNorm: ``x · (mean(x²) + eps)^-½ · w`` (plain weight; none for v_norm)."""
    y = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return y if w is None else y * w


def _layer_geometry(cfg: dict[str, Any], kind: str) -> tuple[int, float, float]:
    """(head_dim, rope θ, rotated fraction) of a "sliding_attention" or "full_attention" layer."""
    rp = (cfg.get("rope_parameters") or {}).get(kind) or {}
    if kind == "full_attention":
        hd = int(cfg.get("global_head_dim") or cfg["head_dim"])
        theta = float(rp.get("rope_theta", 1_000_000.0))
        frac = float(rp.get("partial_rotary_factor", 1.0)) if rp.get("rope_type", "default") == "proportional" else 1.0
    else:
        hd, theta, frac = int(cfg["head_dim"]), float(rp.get("rope_theta", 10_000.0)), 1.0
    return hd, theta, frac


def _rope(x: T, positions: T, theta: float, frac: float) -> T:
    """rotate-half RoPE on (..., n, hd): inverse frequencies θ^(-2i/hd) for i < int(frac·hd/2), zero after."""
    hd = x.shape[-1]
    n_rot = int(frac * hd // 2)
    inv = torch.zeros(hd // 2, dtype=torch.float64)
    inv[:n_rot] = 1.0 / theta ** (torch.arange(0, 2 * n_rot, 2, dtype=torch.float64) / hd)
    ang = positions.to(torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat((-x2, x1), -1) * sin


def _attend(q: T, k: T, v: T, visible: T) -> T:
    """q (H, nq, hd), k/v (Hkv, nk, hd), visible (nq, nk) bool; scaling 1 (Gemma 4): (nq, H·hd)."""
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    s = (q @ k.transpose(1, 2)).masked_fill(~visible, float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(0, 1).reshape(q.shape[1], -1)


def _visible(q_pos: T, k_pos: T, sliding: bool, window: int, extra: int = 0) -> T:
    """Causal mask (key at or before the query), within ``window (+ extra)`` on sliding layers."""
    d = q_pos[:, None] - k_pos[None, :]
    ok = d >= 0
    return ok & (d < window + extra) if sliding else ok


def _gelu(x: T, f16: bool) -> T:
    """gelu_pytorch_tanh; with ``f16``, as ggml's CPU kernels compute it (ggml-cpu vec.h
    ``ggml_vec_gelu_f32`` / ``ggml_vec_geglu_f32`` under GGML_GELU_FP16: 0 below -10, x above 10, else
    ``ggml_table_gelu_f16``, F16 outputs indexed by the F16-rounded input): a property of those kernels,
    not of the forward."""
    if not f16:
        return torch.nn.functional.gelu(x, approximate="tanh")
    y = torch.nn.functional.gelu(x.to(torch.float16).to(torch.float32), approximate="tanh")
    y = y.to(torch.float16).to(torch.float64)
    return torch.where(x <= -10.0, torch.zeros_like(x), torch.where(x >= 10.0, x, y))


def _block_tail(x: T, attn: T, sd: dict[str, T], p: str, eps: float, f16_gelu: bool = False) -> T:
    """The rest of Gemma4TextDecoderLayer after the attention's o_proj output ``attn``."""
    x = x + _rms(attn, sd[p + "post_attention_layernorm.weight"], eps)
    m = _rms(x, sd[p + "pre_feedforward_layernorm.weight"], eps)
    act = _gelu(m @ sd[p + "mlp.gate_proj.weight"].T, f16_gelu)
    f = (act * (m @ sd[p + "mlp.up_proj.weight"].T)) @ sd[p + "mlp.down_proj.weight"].T
    x = x + _rms(f, sd[p + "post_feedforward_layernorm.weight"], eps)
    return x * sd.get(p + "layer_scalar", torch.ones(1, dtype=torch.float64))


def target_forward(cfg: dict[str, Any], sd: dict[str, T], tokens: list[int], f16_gelu: bool = False,
                   softcap: float | None = None) -> tuple[T, T, dict[str, tuple[T, T, T]]]:
    """Gemma4ForCausalLM over ``tokens`` at positions 0..n-1: (logits (n, V), post-final-norm h (n, H),
    {layer type: (K (Hkv, n, hd) normed and roped, V (Hkv, n, hd) v-normed, key positions)} of the
    LAST layer of each type: what the assistant reads). ``f16_gelu``: see _gelu; ``softcap``: the final
    logit soft-cap in place of the config's."""
    if cfg.get("hidden_size_per_layer_input") or cfg.get("enable_moe_block") or cfg.get("attention_k_eq_v"):
        raise NotImplementedError("per-layer inputs, MoE blocks and k=v attention are not ported")
    eps, n = float(cfg["rms_norm_eps"]), len(tokens)
    n_head, window = int(cfg["num_attention_heads"]), int(cfg["sliding_window"])
    pos = torch.arange(n)
    x = sd["model.embed_tokens.weight"][torch.tensor(tokens)] * math.sqrt(int(cfg["hidden_size"]))
    shared: dict[str, tuple[T, T, T]] = {}
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        hd, theta, frac = _layer_geometry(cfg, kind)
        a = _rms(x, sd[p + "input_layernorm.weight"], eps)
        q = _rms((a @ sd[p + "self_attn.q_proj.weight"].T).view(n, n_head, hd), sd[p + "self_attn.q_norm.weight"], eps)
        k = _rms((a @ sd[p + "self_attn.k_proj.weight"].T).view(n, -1, hd), sd[p + "self_attn.k_norm.weight"], eps)
        v = _rms((a @ sd[p + "self_attn.v_proj.weight"].T).view(n, -1, hd), None, eps).transpose(0, 1)
        q, k = _rope(q.transpose(0, 1), pos, theta, frac), _rope(k.transpose(0, 1), pos, theta, frac)
        shared[kind] = (k, v, pos)
        o = _attend(q, k, v, _visible(pos, pos, kind == "sliding_attention", window))
        x = _block_tail(x, o @ sd[p + "self_attn.o_proj.weight"].T, sd, p, eps, f16_gelu)
    h = _rms(x, sd["model.norm.weight"], eps)
    logits = h @ sd.get("lm_head.weight", sd["model.embed_tokens.weight"]).T
    if cap := softcap or cfg.get("final_logit_softcapping"):
        logits = torch.tanh(logits / cap) * cap
    return logits, h, shared


def assistant_forward(cfg: dict[str, Any], sd: dict[str, T], target_embed: T, shared: dict[str, tuple[T, T, T]],
                      tokens: list[int], h: T, position: int, window_extra: int = 0,
                      f16_gelu: bool = False) -> tuple[T, T]:
    """Gemma4AssistantForCausalLM on the pairs (tokens[i], h[i]), all at ``position``, each on its own
    (a draft step is one pair): (logits (n, V), next h (n, H_target)). ``target_embed``: the target's
    token table (unscaled); ``shared``: target_forward's K/V, of which the keys at positions < position
    are read."""
    eps, n = float(cfg["rms_norm_eps"]), len(tokens)
    n_head, window = int(cfg["num_attention_heads"]), int(cfg["sliding_window"])
    emb = target_embed[torch.tensor(tokens)] * math.sqrt(target_embed.shape[1])
    x = torch.cat([emb, h.to(torch.float64)], -1) @ sd["pre_projection.weight"].T
    qpos = torch.full((n,), position)
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        hd, theta, frac = _layer_geometry(cfg, kind)
        k, v, kpos = shared[kind]
        keep = kpos < position
        a = _rms(x, sd[p + "input_layernorm.weight"], eps)
        q = _rms((a @ sd[p + "self_attn.q_proj.weight"].T).view(n, n_head, hd), sd[p + "self_attn.q_norm.weight"], eps)
        q = _rope(q.transpose(0, 1), qpos, theta, frac)
        vis = _visible(qpos, kpos[keep], kind == "sliding_attention", window, window_extra)
        o = _attend(q, k[:, keep], v[:, keep], vis)
        x = _block_tail(x, o @ sd[p + "self_attn.o_proj.weight"].T, sd, p, eps, f16_gelu)
    out = _rms(x, sd["model.norm.weight"], eps)
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    return out @ head.T, out @ sd["post_projection.weight"].T


class Reference:
    """The target / assistant pair of ``target_dir`` / ``assistant_dir`` (HF layout), float64;
    ``f16_gelu``: GELU as ggml's CPU kernel rounds it (see _gelu)."""

    def __init__(self, target_dir: str | Path, assistant_dir: str | Path, f16_gelu: bool = False) -> None:
        _, self.tcfg, self.tsd = load_hf(target_dir)
        top, self.acfg, self.asd = load_hf(assistant_dir)
        self.f16_gelu = f16_gelu
        if top.get("use_ordered_embeddings"):
            raise NotImplementedError("the ordered (centroid-masked) embedding head is not ported")
        if int(top.get("backbone_hidden_size", self.tcfg["hidden_size"])) != int(self.tcfg["hidden_size"]):
            raise ValueError("the assistant reads rows of another width than this target's")

    def _target(self, tokens: list[int], softcap: float | None = None) -> tuple[T, T, dict[str, tuple[T, T, T]]]:
        return target_forward(self.tcfg, self.tsd, list(tokens), self.f16_gelu, softcap)

    def _step(self, shared: dict[str, tuple[T, T, T]], token: int, h: T, position: int,
              window_extra: int = 0) -> tuple[T, T]:
        logits, h_next = assistant_forward(self.acfg, self.asd, self.tsd["model.embed_tokens.weight"], shared,
                                           [token], h, position, window_extra, self.f16_gelu)
        return logits[0], h_next

    def target(self, tokens: list[int], softcap: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The target's (logits (n, V), post-norm h (n, H)) over ``tokens`` (``softcap``: a final logit
        soft-cap in place of the config's)."""
        logits, h, _ = self._target(tokens, softcap)
        return logits.numpy(), h.numpy()

    def first_steps(self, context: list[int], cuts: list[int], window_extra: int = 0) -> np.ndarray:
        """For each cut N: the assistant's first draft step after context[:N] (the pair (c_{N-1},
        h_{N-2}) at position N-1 over the target's K/V of 0..N-2): logits (len(cuts), V). One target
        pass over context[:max(cuts) - 1] serves every cut (it is causal)."""
        _, h, shared = self._target(context[: max(cuts) - 1])
        return torch.stack([self._step(shared, context[c - 1], h[c - 2: c - 1], c - 1, window_extra)[0]
                            for c in cuts]).numpy()

    def greedy_chain(self, context: list[int], gamma: int) -> tuple[list[int], np.ndarray]:
        """γ greedy draft steps after ``context`` (step i+1: (x̃ᵢ, its own next h) at position N-1):
        (tokens, logits (γ, V))."""
        n = len(context)
        _, h, shared = self._target(context[:-1])
        tok, row, out, rows = context[-1], h[-1:], [], []
        for _ in range(gamma):
            logits, row = self._step(shared, tok, row, n - 1)
            rows.append(logits.numpy())
            tok = int(torch.argmax(logits))
            out.append(tok)
        return out, np.stack(rows)
