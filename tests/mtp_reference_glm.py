"""An independent torch (float64) port of the GLM-4.5 / 4.6 MTP ("nextn") forward (``Glm4MoeForCausalLM``),
from the HF layout.

Written from the upstream code, not from edgespec's drafters:
- vLLM ``vllm/model_executor/models/glm4_moe_mtp.py`` (commit 028aedf62adee9d2a1e99d4cda7c1ce1c997c8cc,
  ``Glm4MoeMultiTokenPredictorLayer.forward``): ``e = enorm(embed_tokens(x))``, ``h = hnorm(h)``,
  ``eh_proj(cat([e, h]))``, one ``Glm4MoeDecoderLayer`` (``mtp_block``: every non-nextn tensor of
  ``model.layers.{num_hidden_layers}``), ``residual + hidden_states``; ``compute_logits``: ``shared_head.norm``
  then ``shared_head.head``. The embedding is the nextn layer's own ``model.layers.{n}.embed_tokens``
  (``_rewrite_spec_layer_name`` loads it as the predictor's ``embed_tokens``).
- vLLM ``vllm/model_executor/models/glm4_moe.py`` (commit 002d6073aa03) for the decoder layer:
  ``Glm4MoeAttention`` (q/k/v with ``attention_bias``, per-head ``q_norm``/``k_norm`` when ``use_qk_norm``,
  RoPE on ``head_dim · partial_rotary_factor`` dims, scale ``head_dim ** -0.5``, o_proj without bias),
  pre-norm residual ``Glm4MoeDecoderLayer``, ``Glm4MoE`` (fp32 router ``gate``, ``scoring_func="sigmoid"``,
  ``e_score_correction_bias``, grouped top-k, ``renormalize=norm_topk_prob``, ``routed_scaling_factor``,
  plus ``shared_experts``: an MLP of ``moe_intermediate_size · n_shared_experts``); the routing spelled out
  as transformers 5.24 ``models/glm4_moe/modeling_glm4_moe.py`` ``Glm4MoeTopkRouter`` does it (the bias
  only chooses the experts; the weights are the unbiased sigmoid scores), its ``rotate_half`` /
  ``apply_rotary_pos_emb`` (NeoX halves on the first rotary dims: ``mtp_reference._rope``) and
  ``Glm4MoeRMSNorm`` (``w · x̂``, not zero-centred as Qwen3.5's).
- The pairing and the fed-back row are llama.cpp's (vendored in llama-cpp-python 0.3.36,
  ggml-org/llama.cpp@0c1e57098: ``common/speculative.cpp`` ``common_speculative_impl_draft_mtp``,
  ``src/models/glm4-moe.cpp`` ``graph_mtp``): MTP position p takes (x_p, the target's ``h_nextn`` of p-1,
  which the trunk graph takes after ``output_norm``), position 0 a zero row, RoPE position p; a draft step
  feeds back the MTP block's own ``h_nextn``, which glm4-moe.cpp takes AFTER ``shared_head_norm``. vLLM
  differs in bookkeeping only: it pairs (x_{p+1}, h_p) at position p and zeroes the embedding at
  position 0 instead of the hidden row, and chains on the block's pre-norm output.

Whole sequence at once with a causal mask, float64: a drafter that runs position by position with a KV
cache must agree with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from mtp_reference import _rope, load_hf

T = torch.Tensor
__all__ = ["load_hf", "mtp_forward", "context_logits", "greedy_chain", "target_hidden"]


def _rms(x: T, w: T, eps: float) -> T:
    """Glm4MoeRMSNorm: ``w · x / rms(x)``."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _mlp(x: T, sd: dict[str, T], p: str) -> T:
    """Glm4MoeMLP: down(silu(gate(x)) · up(x))."""
    return (torch.nn.functional.silu(x @ sd[p + "gate_proj.weight"].T) * (x @ sd[p + "up_proj.weight"].T)) \
        @ sd[p + "down_proj.weight"].T


def _moe(cfg: dict[str, Any], sd: dict[str, T], p: str, x: T) -> T:
    """Glm4MoE on (n, H): sigmoid router, biased top-k choice, unbiased (renormalised, scaled) weights,
    plus the shared experts."""
    n_exp, k = int(cfg["n_routed_experts"]), int(cfg["num_experts_per_tok"])
    n_group, topk_group = int(cfg.get("n_group", 1)), int(cfg.get("topk_group", 1))
    scores = torch.sigmoid(x @ sd[p + "gate.weight"].T)  # (n, E)
    choice = scores + sd[p + "gate.e_score_correction_bias"]
    if n_group > 1:  # grouped top-k: keep the topk_group groups with the best two-expert sums
        g = choice.view(-1, n_group, n_exp // n_group)
        keep = g.topk(2, dim=-1)[0].sum(-1).topk(topk_group, dim=-1)[1]
        mask = torch.zeros_like(g[..., 0], dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(n_exp // n_group, dim=1), float("-inf"))
    idx = choice.topk(k, dim=-1)[1]  # (n, k)
    w = scores.gather(1, idx)
    if cfg.get("norm_topk_prob", True):
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * float(cfg.get("routed_scaling_factor", 1.0))
    out = torch.zeros_like(x)
    for j in range(n_exp):
        rows, slot = torch.nonzero(idx == j, as_tuple=True)
        if len(rows):
            out[rows] += w[rows, slot, None] * _mlp(x[rows], sd, p + f"experts.{j}.")
    return out + _mlp(x, sd, p + "shared_experts.")


def decoder_layer(cfg: dict[str, Any], sd: dict[str, T], p: str, x: T, positions: T, moe: bool) -> T:
    """Glm4MoeDecoderLayer over (n, H), causal attention over the n rows."""
    eps = float(cfg.get("rms_norm_eps", 1e-5))
    n_head, n_kv = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    hd = int(cfg.get("head_dim") or cfg["hidden_size"] // n_head)
    rp = cfg.get("rope_parameters") or {}
    theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rot = int(hd * float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))))
    n = x.shape[0]
    a = _rms(x, sd[p + "input_layernorm.weight"], eps)

    def proj(name: str, heads: int) -> T:
        y = a @ sd[f"{p}self_attn.{name}_proj.weight"].T
        if f"{p}self_attn.{name}_proj.bias" in sd:
            y = y + sd[f"{p}self_attn.{name}_proj.bias"]
        return y.view(n, heads, hd)

    q, k, v = proj("q", n_head), proj("k", n_kv), proj("v", n_kv)
    if cfg.get("use_qk_norm"):
        q, k = _rms(q, sd[p + "self_attn.q_norm.weight"], eps), _rms(k, sd[p + "self_attn.k_norm.weight"], eps)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (heads, n, hd)
    q, k = _rope(q, positions, theta, rot), _rope(k, positions, theta, rot)
    rep = n_head // n_kv
    k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
    scores = q @ k.transpose(1, 2) * hd ** -0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).reshape(n, n_head * hd)
    x = x + o @ sd[p + "self_attn.o_proj.weight"].T
    m = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)
    return x + (_moe(cfg, sd, p + "mlp.", m) if moe else _mlp(m, sd, p + "mlp."))


def mtp_forward(cfg: dict[str, Any], sd: dict[str, T], tokens: list[int], h: T, positions: T) -> tuple[T, T]:
    """The MTP over n pairs (tokens[i], h[i]) at ``positions``, causal: (logits (n, V), MTP output (n, H)),
    the output being after ``shared_head.norm`` (what a llama.cpp draft step feeds back)."""
    eps = float(cfg.get("rms_norm_eps", 1e-5))
    n_layer = int(cfg["num_hidden_layers"])
    p = f"model.layers.{n_layer}."
    emb_w = sd.get(p + "embed_tokens.weight", sd["model.embed_tokens.weight"])
    e = _rms(emb_w[torch.tensor(tokens)], sd[p + "enorm.weight"], eps)
    hn = _rms(h.to(torch.float64), sd[p + "hnorm.weight"], eps)
    x = torch.cat([e, hn], dim=-1) @ sd[p + "eh_proj.weight"].T
    x = decoder_layer(cfg, sd, p, x, positions, moe=n_layer >= int(cfg.get("first_k_dense_replace", 0)))
    out = _rms(x, sd.get(p + "shared_head.norm.weight", sd["model.norm.weight"]), eps)
    head = sd.get(p + "shared_head.head.weight", sd.get("lm_head.weight", sd["model.embed_tokens.weight"]))
    return out @ head.T, out


def _pairs_h(cfg: dict[str, Any], n: int, h_target: np.ndarray) -> T:
    h = torch.zeros(n, int(cfg["hidden_size"]), dtype=torch.float64)
    h[1:] = torch.as_tensor(np.asarray(h_target[: n - 1], np.float64))
    return h


def context_logits(cfg: dict[str, Any], sd: dict[str, T], context: list[int], h_target: np.ndarray) -> np.ndarray:
    """llama.cpp's pairing over c_0..c_{n-1}: row p = (c_p, h_{p-1}), h_{-1} = 0; ``h_target`` holds the
    target's post-norm rows of c_0..c_{n-2}. Row p's logits are the MTP's distribution of c_{p+1}: (n, V)."""
    n = len(context)
    logits, _ = mtp_forward(cfg, sd, list(context), _pairs_h(cfg, n, h_target), torch.arange(n))
    return logits.numpy()


def greedy_chain(cfg: dict[str, Any], sd: dict[str, T], context: list[int], h_target: np.ndarray,
                 gamma: int) -> tuple[list[int], np.ndarray]:
    """γ greedy draft steps after ``context`` (step i adds (x̃ᵢ, the MTP's own output row of the previous
    position) at the next position), recomputed whole at every step: (tokens, logits (γ, V))."""
    toks, h = list(context), _pairs_h(cfg, len(context), h_target)
    rows, drafted = [], []
    for _ in range(gamma):
        logits, out = mtp_forward(cfg, sd, toks, h, torch.arange(len(toks)))
        rows.append(logits[-1].numpy())
        drafted.append(int(torch.argmax(logits[-1])))
        toks.append(drafted[-1])
        h = torch.cat([h, out[-1:]], dim=0)
    return drafted, np.stack(rows)


def target_hidden(hf_dir: str | Path, tokens: list[int]) -> np.ndarray:
    """The target's post-final-norm hidden rows (n, H) from transformers' own ``Glm4MoeForCausalLM``
    (float64, the eager experts loop: grouped_mm takes no float64; it ignores the nextn layer's tensors on
    load): what the MTP reads."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float64, experts_implementation="eager")
    model.eval()
    with torch.no_grad():
        out = model.model(torch.tensor([tokens]))
    return out.last_hidden_state[0].numpy()
