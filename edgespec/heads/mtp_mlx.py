"""The Qwen3.5 / Qwen3.6 MTP ("nextn") block on MLX, and its weights from a GGUF or an HF checkpoint.

What it computes (llama.cpp 0.3.36's ``src/models/qwen35.cpp``, ``graph_mtp``; vLLM's
``qwen3_5_mtp.py`` ``Qwen3_5MultiTokenPredictor.forward``, commit 01d99805d1ef): for a pair (token x, h)
at position p, ``e = rms(embed(x))·enorm``, ``g = rms(h)·hnorm``, ``y = eh_proj·[e; g]``, then one
full-attention Qwen3.5 decoder block over the MTP's own KV cache (q_proj gives per head [query | gate],
q/k RMS norms per head, NeoX RoPE on the first ``n_rot`` dims, ``attn · sigmoid(gate)``, SiLU FFN), then
``out = rms(y)·shared_head_norm`` (the target's ``output_norm`` when the file has none). The logits are the
target's LM head on ``out``, and ``out`` is what the next draft step takes as h.

Weights (``MtpWeights``): norms are held as their effective multipliers. llama.cpp's converter
(conversion/qwen.py, ``Qwen3NextModel.modify_tensors``) stores Qwen's zero-centred norms + 1, so GGUF norms
are used as they are; an HF checkpoint's ``mtp.*`` norms get + 1 here. mlx-lm 0.32.2's
``qwen3_5.TextModel.sanitize`` drops every ``mtp.*`` tensor, so this module reads them itself:
``mtp_weights_from_hf`` from the checkpoint's safetensors, ``mtp_weights_from_gguf`` from the
``blk.{n_layer}.*`` block that ``nextn_predict_layers`` counts (``nextn.eh_proj``, ``nextn.enorm``,
``nextn.hnorm``, optional ``nextn.shared_head_norm`` / ``shared_head_head`` / ``embed_tokens``, and the
attention / FFN tensors of that block).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from edgespec.backends.deps import import_mlx
from edgespec.errors import ModelLoadError

F32 = npt.NDArray[np.float32]
# the block's tensors, by the short names used here (GGUF name after "blk.N.", HF name after "mtp.")
MATRICES = ("eh_proj", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
NORMS = ("enorm", "hnorm", "attn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "out_norm")
_HF = {"eh_proj": "fc", "enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "out_norm": "norm",
       "attn_q": "layers.0.self_attn.q_proj", "attn_k": "layers.0.self_attn.k_proj",
       "attn_v": "layers.0.self_attn.v_proj", "attn_output": "layers.0.self_attn.o_proj",
       "attn_q_norm": "layers.0.self_attn.q_norm", "attn_k_norm": "layers.0.self_attn.k_norm",
       "attn_norm": "layers.0.input_layernorm", "post_attention_norm": "layers.0.post_attention_layernorm",
       "ffn_gate": "layers.0.mlp.gate_proj", "ffn_up": "layers.0.mlp.up_proj", "ffn_down": "layers.0.mlp.down_proj"}
_GGUF = {"eh_proj": "nextn.eh_proj", "enorm": "nextn.enorm", "hnorm": "nextn.hnorm"}


@dataclass(frozen=True)
class MtpConfig:
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int  # RoPE'd dims per head (head_dim · partial_rotary_factor)
    rope_base: float
    eps: float


@dataclass
class MtpWeights:
    """The MTP block: ``tensors`` by the short names above ((out, in) matrices, effective norm weights),
    float32 numpy; ``embed`` / ``head``: the block's own token embeddings / LM head (V, H) when the
    file has them, else None (the target's are used)."""

    config: MtpConfig
    tensors: dict[str, F32]
    embed: F32 | None = None
    head: F32 | None = None


def _first(v: Any, i: int) -> int:
    """A per-layer GGUF array's entry for layer i, or the scalar."""
    return int(v[i]) if isinstance(v, (list, tuple, np.ndarray)) else int(v)


def mtp_weights_from_gguf(path: str | Path) -> MtpWeights:
    """The MTP block of a qwen35 GGUF (ModelLoadError naming the key when it has none)."""
    from edgespec.gguf_file import read_gguf

    f = read_gguf(path)
    arch = f.value("general.architecture")
    n_next = int(f.value(f"{arch}.nextn_predict_layers", 0) or 0)
    if n_next < 1:
        raise ModelLoadError(f"{path} ({arch}) has no MTP layers: {arch}.nextn_predict_layers is absent or 0")
    if arch != "qwen35":  # qwen35moe / qwen3next MTP blocks have a MoE FFN: not built here
        raise ModelLoadError(f"MTP on MLX supports the dense qwen35 MTP block, not {arch}'s ({path})")
    il = int(f.arch_value("block_count")) - n_next
    get = f.arch_value
    n_head = _first(get("attention.head_count"), il)
    hd = int(get("attention.key_length"))
    cfg = MtpConfig(n_embd=int(get("embedding_length")), n_head=n_head,
                    n_head_kv=_first(get("attention.head_count_kv", n_head), il), head_dim=hd,
                    n_rot=int(get("rope.dimension_count", hd)), rope_base=float(get("rope.freq_base", 10000.0)),
                    eps=float(get("attention.layer_norm_rms_epsilon")))
    blk = f"blk.{il}."

    def name(short: str) -> str:
        return blk + _GGUF.get(short, short) + ".weight"

    t: dict[str, F32] = {}
    for short in MATRICES + NORMS[:-1]:
        if name(short) not in f.tensors:
            raise ModelLoadError(f"{path}: MTP block tensor {name(short)} is missing")
        t[short] = f.tensor(name(short))
    out_norm = blk + "nextn.shared_head_norm.weight"
    t["out_norm"] = f.tensor(out_norm if out_norm in f.tensors else "output_norm.weight")
    opt = {k: f.tensor(blk + f"nextn.{k}.weight") for k in ("embed_tokens", "shared_head_head")
           if blk + f"nextn.{k}.weight" in f.tensors}
    return MtpWeights(cfg, t, opt.get("embed_tokens"), opt.get("shared_head_head"))


def hf_mtp_names(model_dir: str | Path) -> dict[str, str]:
    """tensor name → safetensors file for every ``mtp.*`` tensor of an HF / mlx-lm directory."""
    from safetensors import safe_open

    out = {}
    for p in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(p), "np") as sf:
            out |= {k: str(p) for k in sf.keys() if k.startswith("mtp.")}
    return out


def mtp_weights_from_hf(model_dir: str | Path) -> MtpWeights:
    """The MTP block of an HF Qwen3.5 checkpoint (``mtp.*`` tensors, float; norms get + 1)."""
    from safetensors import safe_open

    d = Path(model_dir)
    raw = json.loads((d / "config.json").read_text())
    c = {**raw, **raw.get("text_config", {})}
    files = hf_mtp_names(d)
    if not files:
        raise ModelLoadError(f"{d} ({c.get('model_type')}) has no MTP layers: no mtp.* tensors (mtp_num_hidden_layers="
                             f"{c.get('mtp_num_hidden_layers')}; mlx-lm's converted directories drop them)")
    if "mtp.layers.0.mlp.gate_proj.weight" not in files:  # Qwen3.5-MoE / Qwen3-Next: experts
        raise ModelLoadError(f"{d}: MTP on MLX supports the dense Qwen3.5 MTP block, not a MoE one "
                             f"({c.get('model_type')})")
    n_head = int(c["num_attention_heads"])
    hd = int(c.get("head_dim") or c["hidden_size"] // n_head)
    rp = c.get("rope_parameters") or {}
    cfg = MtpConfig(n_embd=int(c["hidden_size"]), n_head=n_head, n_head_kv=int(c["num_key_value_heads"]),
                    head_dim=hd, n_rot=int(hd * float(rp.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25)))),
                    rope_base=float(rp.get("rope_theta", c.get("rope_theta", 10000.0))),
                    eps=float(c.get("rms_norm_eps", 1e-6)))
    t: dict[str, F32] = {}
    for short, hf in _HF.items():
        key = f"mtp.{hf}.weight"
        if key not in files:
            raise ModelLoadError(f"{d}: MTP tensor {key} is missing")
        with safe_open(files[key], "np") as sf:
            a = np.asarray(sf.get_tensor(key), np.float32)
        t[short] = a + 1.0 if short in NORMS else a
    return MtpWeights(cfg, t)


def load_mtp_weights(source: str | Path) -> MtpWeights:
    """``mtp_weights_from_gguf`` for a file, ``mtp_weights_from_hf`` for a directory."""
    p = Path(source).expanduser()
    return mtp_weights_from_hf(p) if p.is_dir() else mtp_weights_from_gguf(p)


class MlxMtpHead:
    """The MTP block on MLX with its own KV cache (positions 0..n_past-1, appended in order).

    Args:
        weights: the block (MtpWeights).
        embed: token ids (mx int array (1, n)) → embeddings (1, n, H): the target's ``embed_tokens``
            (used when ``weights.embed`` is None).
        head: hidden (1, n, H) → logits (1, n, V): the target's LM head (when ``weights.head`` is None).
    """

    def __init__(self, weights: MtpWeights, embed: Callable[[Any], Any] | None = None,
                 head: Callable[[Any], Any] | None = None) -> None:
        self._mx = mx = import_mlx()
        self.config = c = weights.config
        self.n_embd = c.n_embd
        self._w = {k: mx.array(np.ascontiguousarray(v.T if k in MATRICES else v, np.float32))
                   for k, v in weights.tensors.items()}  # matrices (in, out)
        want = {"eh_proj": (2 * c.n_embd, c.n_embd), "attn_q": (c.n_embd, 2 * c.n_head * c.head_dim),
                "attn_k": (c.n_embd, c.n_head_kv * c.head_dim), "attn_output": (c.n_head * c.head_dim, c.n_embd)}
        for k, shape in want.items():
            if tuple(self._w[k].shape) != shape:
                raise ModelLoadError(f"MTP tensor {k} is {tuple(self._w[k].shape)[::-1]}, expected {shape[::-1]}")
        if weights.embed is not None:
            table = mx.array(np.asarray(weights.embed, np.float32))
            embed = lambda ids: table[ids]  # noqa: E731
        if weights.head is not None:
            hw = mx.array(np.ascontiguousarray(np.asarray(weights.head, np.float32).T))
            head = lambda x: x @ hw  # noqa: E731
        if embed is None or head is None:
            raise ValueError("MlxMtpHead needs the target's embeddings and LM head (the block has none)")
        self._embed, self._head = embed, head
        kv = (1, c.n_head_kv, 0, c.head_dim)
        self._k, self._v = mx.zeros(kv, mx.float32), mx.zeros(kv, mx.float32)
        mx.eval(self._k, self._v)  # evaluated where made (mlx_ops.mx_matrix: streams are per thread)

    @property
    def n_past(self) -> int:
        return int(self._k.shape[2])

    def truncate(self, n_past: int) -> None:
        """Drop the KV entries of positions ≥ n_past."""
        if n_past < self.n_past:
            self._k, self._v = self._k[:, :, :n_past], self._v[:, :, :n_past]
            self._mx.eval(self._k, self._v)  # evaluated on this thread (see __init__)

    def _rms(self, x: Any, name: str) -> Any:
        return self._mx.fast.rms_norm(x, self._w[name], self.config.eps)

    def decode(self, tokens: Sequence[int], h: Any, rows: Literal["all", "last"] = "all") -> tuple[F32, F32]:
        """Append the pairs (tokens[i], h[i]) at positions n_past.. and return (logits, out) of the
        rows asked for: logits (rows, V) float32 and the block's output (rows, H), the next step's h."""
        mx, c, w = self._mx, self.config, self._w
        n = len(tokens)
        hx = mx.array(np.asarray(h, np.float32)).reshape(1, n, c.n_embd)
        e = self._embed(mx.array([list(tokens)])).astype(mx.float32)
        y = mx.concatenate([self._rms(e, "enorm"), self._rms(hx, "hnorm")], axis=-1) @ w["eh_proj"]
        a = self._rms(y, "attn_norm")
        qg = (a @ w["attn_q"]).reshape(1, n, c.n_head, 2 * c.head_dim)
        q, gate = qg[..., :c.head_dim], qg[..., c.head_dim:].reshape(1, n, c.n_head * c.head_dim)
        q = self._rms(q, "attn_q_norm").transpose(0, 2, 1, 3)
        k = self._rms((a @ w["attn_k"]).reshape(1, n, c.n_head_kv, c.head_dim), "attn_k_norm").transpose(0, 2, 1, 3)
        v = (a @ w["attn_v"]).reshape(1, n, c.n_head_kv, c.head_dim).transpose(0, 2, 1, 3)
        p0 = self.n_past
        q = mx.fast.rope(q, c.n_rot, traditional=False, base=c.rope_base, scale=1.0, offset=p0)
        k = mx.fast.rope(k, c.n_rot, traditional=False, base=c.rope_base, scale=1.0, offset=p0)
        self._k = mx.concatenate([self._k, k], axis=2)
        self._v = mx.concatenate([self._v, v], axis=2)
        mask = "causal" if n > 1 else None
        o = mx.fast.scaled_dot_product_attention(q, self._k, self._v, scale=c.head_dim ** -0.5, mask=mask)
        o = o.transpose(0, 2, 1, 3).reshape(1, n, c.n_head * c.head_dim)
        y = y + (o * mx.sigmoid(gate)) @ w["attn_output"]
        m = self._rms(y, "post_attention_norm")
        g = m @ w["ffn_gate"]
        y = y + (g * mx.sigmoid(g) * (m @ w["ffn_up"])) @ w["ffn_down"]
        out = self._rms(y if rows == "all" else y[:, -1:], "out_norm")
        logits = self._head(out).astype(mx.float32)
        mx.eval(logits, out, self._k, self._v)
        return np.array(logits[0], copy=True), np.array(out[0], copy=True)

    def close(self) -> None:
        kv = (1, self.config.n_head_kv, 0, self.config.head_dim)
        self._k, self._v = self._mx.zeros(kv, self._mx.float32), self._mx.zeros(kv, self._mx.float32)


def target_embed_head(model: Any) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """The token-embedding and LM-head callables of an mlx-lm model (quantized or not; tied or not)."""
    body = model.model
    lm = getattr(model, "language_model", model)
    head = lm.lm_head if "lm_head" in lm else body.embed_tokens.as_linear
    return body.embed_tokens, head


def check_weights(weights: MtpWeights, n_vocab: int, n_embd: int) -> None:
    """ModelLoadError unless the block fits a target of width n_embd (and vocabulary n_vocab)."""
    if weights.config.n_embd != n_embd:
        raise ModelLoadError(f"the MTP block is {weights.config.n_embd} wide, the target {n_embd}")
    for what, m in (("embed_tokens", weights.embed), ("shared_head_head", weights.head)):
        if m is not None and m.shape[0] != n_vocab:
            raise ModelLoadError(f"the MTP block's {what} has {m.shape[0]} rows, the target's vocabulary {n_vocab}")

