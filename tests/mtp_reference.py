"""An independent torch (float64) port of the Qwen3.5 / Qwen3.6 MTP ("nextn") forward, from the HF layout.

Written from the upstream code, not from edgespec's MLX or libllama drafters:
- vLLM ``vllm/model_executor/models/qwen3_5_mtp.py`` (commit 01d99805d1ef, ``Qwen3_5MultiTokenPredictor.forward``):
  ``e = pre_fc_norm_embedding(embed_tokens(x))``, ``h = pre_fc_norm_hidden(h)``, ``fc(cat([e, h]))``, one
  full-attention ``Qwen3_5DecoderLayer``, then ``norm``; the logits are the target's ``lm_head`` (the tied
  embeddings when ``tie_word_embeddings``);
- transformers 5.24 ``models/qwen3_5/modeling_qwen3_5.py`` for the decoder layer's parts:
  ``Qwen3_5RMSNorm`` (zero-centred: ``x̂ · (1 + w)``), ``Qwen3_5Attention.forward`` (q_proj gives per head
  [query | gate]; q_norm / k_norm per head; ``attn · sigmoid(gate)`` before o_proj), ``apply_rotary_pos_emb`` /
  ``rotate_half`` (NeoX halves on the first ``head_dim · partial_rotary_factor`` dims; the interleaved MRoPE
  of ``Qwen3_5TextRotaryEmbedding`` with equal t/h/w positions for text is this plain RoPE),
  ``Qwen3_5MLP`` (SiLU-gated) and ``Qwen3_5DecoderLayer`` (pre-norm residual blocks). transformers itself
  defines no MTP module: ``Qwen3_5ForCausalLM._keys_to_ignore_on_load_unexpected = [r"^mtp.*"]``.
- The pairing of inputs is llama.cpp's (vendored in llama-cpp-python 0.3.36, ``common/speculative.cpp``,
  ``common_speculative_impl_draft_mtp::process`` / ``draft``): the MTP row at position p takes the token x_p
  and the target's hidden state of position p-1, the first row of a sequence takes a zero vector
  (``pending_h`` starts at zeros), RoPE position p; a draft step feeds back the MTP's own output row.
  The hidden state is the target's ``h_nextn``, which ``src/models/qwen35.cpp`` takes AFTER the final
  ``output_norm`` (vLLM likewise hands the MTP the target model's normed output; the MTP's own
  ``h_nextn`` is after ``mtp.norm``). vLLM differs only in bookkeeping: it shifts the pairs to the
  positions of h and has no zero first row, so its logits differ from llama.cpp's by the extra key.

Whole sequence at once with a causal mask, float64, as the training code would run it: a drafter that
runs position by position with a KV cache must agree with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

T = torch.Tensor


def load_hf(hf_dir: str | Path) -> tuple[dict[str, Any], dict[str, T]]:
    """(text config, float64 state dict) of an HF Qwen3.5 checkpoint with ``mtp.*`` tensors. Keys are
    normalised to ``model.*`` / ``lm_head.weight`` / ``mtp.*`` (ForConditionalGeneration keeps the
    text model under ``model.language_model``)."""
    from safetensors.torch import load_file

    d = Path(hf_dir)
    cfg = json.loads((d / "config.json").read_text())
    cfg = {**cfg, **cfg.get("text_config", {})}
    sd: dict[str, T] = {}
    for f in sorted(d.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            k = k.replace("model.language_model.", "model.")
            sd[k] = v.to(torch.float64)
    return cfg, sd


def _rms(x: T, w: T, eps: float) -> T:
    """Qwen3_5RMSNorm: zero-centred weight."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def _rotate_half(x: T) -> T:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: T, positions: T, theta: float, rot: int) -> T:
    """apply_rotary_pos_emb on (heads, n, head_dim) with the default inverse frequencies on ``rot`` dims."""
    inv = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    freqs = positions.to(torch.float64)[:, None] * inv[None]  # (n, rot/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    xr, xp = x[..., :rot], x[..., rot:]
    return torch.cat((xr * cos + _rotate_half(xr) * sin, xp), dim=-1)


def mtp_forward(cfg: dict[str, Any], sd: dict[str, T], tokens: list[int], h: T, positions: T) -> tuple[T, T]:
    """The MTP over n pairs (tokens[i], h[i]) at ``positions``, causal: (logits (n, V), MTP output (n, H)),
    the output being after ``mtp.norm`` (what a draft step feeds back)."""
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    n_head, n_kv = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    hd = int(cfg.get("head_dim") or cfg["hidden_size"] // n_head)
    rp = cfg.get("rope_parameters") or {}
    theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rot = int(hd * float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))))
    n = len(tokens)
    emb_w = sd["model.embed_tokens.weight"]
    e = _rms(emb_w[torch.tensor(tokens)], sd["mtp.pre_fc_norm_embedding.weight"], eps)
    hn = _rms(h.to(torch.float64), sd["mtp.pre_fc_norm_hidden.weight"], eps)
    x = torch.cat([e, hn], dim=-1) @ sd["mtp.fc.weight"].T  # (n, H)
    p = "mtp.layers.0."
    # Qwen3_5DecoderLayer, full attention
    a = _rms(x, sd[p + "input_layernorm.weight"], eps)
    qg = (a @ sd[p + "self_attn.q_proj.weight"].T).view(n, n_head, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(n, n_head * hd)
    q = _rms(q, sd[p + "self_attn.q_norm.weight"], eps).transpose(0, 1)  # (heads, n, hd)
    k = _rms((a @ sd[p + "self_attn.k_proj.weight"].T).view(n, n_kv, hd), sd[p + "self_attn.k_norm.weight"], eps)
    k = k.transpose(0, 1)
    v = (a @ sd[p + "self_attn.v_proj.weight"].T).view(n, n_kv, hd).transpose(0, 1)
    q, k = _rope(q, positions, theta, rot), _rope(k, positions, theta, rot)
    rep = n_head // n_kv  # repeat_kv
    k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
    scores = q @ k.transpose(1, 2) * hd ** -0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).reshape(n, n_head * hd)
    x = x + (o * torch.sigmoid(gate)) @ sd[p + "self_attn.o_proj.weight"].T
    m = _rms(x, sd[p + "post_attention_layernorm.weight"], eps)
    act = torch.nn.functional.silu(m @ sd[p + "mlp.gate_proj.weight"].T) * (m @ sd[p + "mlp.up_proj.weight"].T)
    x = x + act @ sd[p + "mlp.down_proj.weight"].T
    out = _rms(x, sd["mtp.norm.weight"], eps)
    head = sd.get("lm_head.weight", emb_w) if not cfg.get("tie_word_embeddings") else emb_w
    return out @ head.T, out


def context_logits(cfg: dict[str, Any], sd: dict[str, T], context: list[int], h_target: np.ndarray) -> np.ndarray:
    """llama.cpp's pairing over a context c_0..c_{n-1}: row p = (c_p, h_{p-1}), h_{-1} = 0; ``h_target``
    holds the target's (post-norm) hidden states of c_0..c_{n-2} (more rows are ignored). Row p's logits
    are the MTP's distribution of c_{p+1}; the last row's is the first draft token's, the token after the
    pending c_{n-1}: (n, V) float64."""
    n = len(context)
    h = torch.zeros(n, int(cfg["hidden_size"]), dtype=torch.float64)
    h[1:] = torch.as_tensor(np.asarray(h_target[: n - 1], np.float64))
    logits, _ = mtp_forward(cfg, sd, list(context), h, torch.arange(n))
    return logits.numpy()


def greedy_chain(cfg: dict[str, Any], sd: dict[str, T], context: list[int], h_target: np.ndarray,
                 gamma: int) -> tuple[list[int], np.ndarray]:
    """γ greedy draft steps after ``context`` (llama.cpp's ``draft``: step i adds the pair (x̃ᵢ, the MTP's
    own output row of the previous position) at the next position), the whole sequence recomputed at
    every step: (tokens, logits (γ, V) of the positions that drew them)."""
    n = len(context)
    toks = list(context)
    h = torch.zeros(n, int(cfg["hidden_size"]), dtype=torch.float64)
    h[1:] = torch.as_tensor(np.asarray(h_target[: n - 1], np.float64))
    rows, drafted = [], []
    for _ in range(gamma):
        logits, out = mtp_forward(cfg, sd, toks, h, torch.arange(len(toks)))
        rows.append(logits[-1].numpy())
        x = int(torch.argmax(logits[-1]))
        drafted.append(x)
        toks.append(x)
        h = torch.cat([h, out[-1:]], dim=0)
    return drafted, np.stack(rows)


def target_hidden(hf_dir: str | Path, tokens: list[int]) -> np.ndarray:
    """The target's post-final-norm hidden states (n, H) for ``tokens``, from transformers' own Qwen3.5
    (``Qwen3_5ForCausalLM``, float64, torch gated-delta fallback): what the MTP reads."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        out = model.model(torch.tensor([tokens]))
    return out.last_hidden_state[0].numpy()  # after model.norm
