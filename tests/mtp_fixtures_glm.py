"""A tiny random-weight GLM-4.5-style MoE checkpoint (``Glm4MoeForCausalLM``) WITH its multi-token-prediction
("nextn") layer, in the HF layout, and its F32 GGUF written by llama.cpp's own vendored converter: the
second MTP architecture the tests cover, attention-only (tests/mtp_fixtures.py's Qwen3.5 is a hybrid).

* ``build_glm4moe_mtp(root)`` -> ``(hf_dir, gguf_path)``: ``hf_dir`` holds config.json (model_type
  ``glm4_moe``, ``num_nextn_predict_layers: 1``), model.safetensors named as the released GLM-4.5 / 4.6
  checkpoints name their tensors (per-expert ``mlp.experts.{j}.*_proj``, ``mlp.gate.e_score_correction_bias``,
  and the nextn layer as one more decoder layer ``model.layers.{num_hidden_layers}.*`` carrying ``eh_proj``,
  ``enorm``, ``hnorm``, ``embed_tokens``, ``shared_head.{norm,head}``), and tokenizer files: mtp_fixtures'
  512-token BPE plus the four specials GLM's converter looks up (``[gMASK]``, ``<sop>``, ``<|user|>``,
  ``<|observation|>``); ``gguf_path`` is ``convert_hf_to_gguf.py hf_dir --outtype f32`` (arch ``glm4moe``,
  ``glm4moe.nextn_predict_layers = 1``, block_count = 2 trunk + 1 MTP block).
* ``glm4moe_mtp`` (a session fixture): ``build_glm4moe_mtp`` once per session.

Shape (GLM-4.5's, shrunk): hidden 64, 4 query heads / 2 KV heads of 16 (partial RoPE on half of each head,
NeoX order), q/k/v biases and per-head q/k RMS norms (GLM-4.5 355B's ``use_qk_norm``); layer 0 dense (SiLU
FFN of 128), layer 1 and the MTP block MoE: 4 routed experts of 32, top 2, one shared expert, sigmoid
router with ``e_score_correction_bias`` (selection only), top-k weights normalised and scaled by 2.5.
llama.cpp's glm4moe MTP graph needs the block to be MoE with a shared expert (``ffn_gate_inp`` asserted,
the shared FFN built unconditionally: src/models/glm4-moe.cpp ``graph_mtp``).

Upstream facts used (llama-cpp-python 0.3.36 sdist, vendor/llama.cpp = ggml-org/llama.cpp@0c1e57098):
conversion/glm.py (``Glm4MoeModel``: block_count += ``num_nextn_predict_layers``, experts stacked per layer,
``_set_vocab_glm`` reads ``[gMASK]``/``<|user|>``/``<|endoftext|>``/``<|observation|>``), conversion/base.py
(``e_score_correction_bias`` -> ``exp_probs_b.bias``), gguf-py tensor_mapping.py (``model.layers.{bid}.eh_proj``
-> ``blk.{bid}.nextn.eh_proj`` etc.), src/models/glm4-moe.cpp (``graph_mtp``: ``eh_proj(concat(enorm(e),
hnorm(h)))``, one decoder block, then ``shared_head_norm`` and ``shared_head_head``, each falling back
to the target's when absent). The converter's BPE pre-tokenizer check is answered "qwen2" by
mtp_fixtures' runner (``convert_hf``).

Weights: the first (dense) block is scaled by ``first_scale`` (0.3), the MoE block by 1; the MTP block is a
copy of that last trunk block + ``mtp_noise`` (0.1) × init noise (router, bias and experts included),
``eh_proj`` the identity on the embedding half + noise, ``enorm``/``hnorm`` 1 + noise, ``shared_head.norm``
the target's final norm, and its own ``embed_tokens`` / ``shared_head.head`` the target's embedding and
LM head + 0.01 × noise (released GLM checkpoints carry copies; the noise makes a graph that read the
target's tensors instead visible to the reference test). ``MEASURED_ACCEPTANCE``: greedy drafts at γ 3.

``glm4moe_mtp_agreeing`` (a session fixture; ``AGREEING``): built so that ``-k auto`` drafts. Three dense
layers at 0.02 scale with FFNs 8192 wide (the target step's cost: ~32 MB of F32 weights, bandwidth-bound
here) before the MoE layer the nextn block copies exactly (``mtp_noise`` 0: ``eh_proj`` = [I | 0], ``enorm``
the identity): the head computes nearly the trunk's function (greedy acceptance about 0.8 at γ 3) for
the cost of one small MoE block, about a tenth of a target step.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from mtp_fixtures import CONFIG as QWEN_CONFIG
from mtp_fixtures import N_VOCAB, convert_hf, write_tokenizer

# Greedy drafts of `mtp` at γ 3 on the default fixture, 128 new tokens after tests/test_mtp_glm.py's
# prompt: 0.36 of 182 drafts accepted (test_glm_fixture_acceptance's printout; llama.cpp, 1 thread).
MEASURED_ACCEPTANCE = 0.36

AGREEING = dict(n_dense=3, first_scale=0.02, mtp_noise=0.0, intermediate_size=8192)  # glm4moe_mtp_agreeing

GLM_SPECIALS = ["[gMASK]", "<sop>", "<|user|>", "<|observation|>"]
N_VOCAB_GLM = N_VOCAB + len(GLM_SPECIALS)

CONFIG = dict(
    architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", vocab_size=N_VOCAB_GLM, hidden_size=64,
    intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5, n_group=1, topk_group=1,
    attention_bias=True, use_qk_norm=True, num_nextn_predict_layers=1, rms_norm_eps=1e-5,
    max_position_embeddings=4096, tie_word_embeddings=False, hidden_act="silu",
    rope_parameters=dict(rope_type="default", rope_theta=10_000.0, partial_rotary_factor=0.5),
    bos_token_id=None, eos_token_id=QWEN_CONFIG["eos_token_id"], torch_dtype="float32")


def write_glm_tokenizer(d: Path) -> None:
    """mtp_fixtures' BPE (ids 0..511 unchanged) + GLM_SPECIALS at 512..515."""
    from tokenizers import Tokenizer

    write_tokenizer(d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_special_tokens(GLM_SPECIALS)
    assert tok.get_vocab_size() == N_VOCAB_GLM, tok.get_vocab_size()
    tok.save(str(d / "tokenizer.json"))


def _tensors(cfg: dict, seed: int, first_scale: float, moe_scale: float, mtp_noise: float,
             output_std: float) -> dict[str, np.ndarray]:
    """HF-named F32 tensors: matrices ~ N(0, 1/fan_in) × scale, norms 1 + 0.1 × N(0, 1), biases 0.1 × N(0, 1)."""
    rng = np.random.default_rng(seed)
    e, ff, ffe, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["moe_intermediate_size"], cfg["vocab_size"]
    hd, nh, nkv, n_exp = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["n_routed_experts"]
    t: dict[str, np.ndarray] = {}

    def mat(name: str, rows: int, cols: int, scale: float) -> None:
        t[name] = (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)

    def vec(name: str, n: int, centre: float) -> None:
        t[name] = (centre + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def mlp(p: str, width: int, s: float) -> None:
        mat(p + "gate_proj.weight", width, e, s)
        mat(p + "up_proj.weight", width, e, s)
        mat(p + "down_proj.weight", e, width, s)

    def block(p: str, s: float, moe: bool) -> None:
        a = p + "self_attn."
        for name, rows in (("q_proj", nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
            mat(a + name + ".weight", rows, e, s)
            vec(a + name + ".bias", rows, 0.0)
        mat(a + "o_proj.weight", e, nh * hd, s)
        vec(a + "q_norm.weight", hd, 1.0)
        vec(a + "k_norm.weight", hd, 1.0)
        vec(p + "input_layernorm.weight", e, 1.0)
        vec(p + "post_attention_layernorm.weight", e, 1.0)
        if not moe:
            mlp(p + "mlp.", ff, s)
            return
        mat(p + "mlp.gate.weight", n_exp, e, 1.0)
        vec(p + "mlp.gate.e_score_correction_bias", n_exp, 0.0)
        for j in range(n_exp):
            mlp(p + f"mlp.experts.{j}.", ffe, s)
        mlp(p + "mlp.shared_experts.", ffe * cfg["n_shared_experts"], s)

    n_layer = cfg["num_hidden_layers"]
    t["model.embed_tokens.weight"] = rng.standard_normal((V, e)).astype(np.float32)
    for i in range(n_layer):
        moe = i >= cfg["first_k_dense_replace"]
        block(f"model.layers.{i}.", moe_scale if moe else first_scale, moe)
    vec("model.norm.weight", e, 1.0)
    t["lm_head.weight"] = (rng.standard_normal((V, e)) * output_std).astype(np.float32)
    # the nextn layer: the last trunk block perturbed, reading mostly the token's embedding
    last, m = f"model.layers.{n_layer - 1}.", f"model.layers.{n_layer}."
    for name in [n for n in t if n.startswith(last)]:
        w = t[name]
        scale = 0.1 if w.ndim == 1 else moe_scale / np.sqrt(w.shape[1])
        t[name.replace(last, m)] = (w + mtp_noise * scale * rng.standard_normal(w.shape)).astype(np.float32)
    eh = rng.standard_normal((e, 2 * e)) * mtp_noise / np.sqrt(2 * e)
    eh[:, :e] += np.eye(e)
    t[m + "eh_proj.weight"] = eh.astype(np.float32)
    vec(m + "enorm.weight", e, 1.0)
    vec(m + "hnorm.weight", e, 1.0)
    if mtp_noise != 0.1:  # their noise follows mtp_noise's (0: the identity)
        for name in (m + "enorm.weight", m + "hnorm.weight"):
            t[name] = (1.0 + (t[name] - 1.0) * np.float32(mtp_noise / 0.1)).astype(np.float32)
    t[m + "shared_head.norm.weight"] = t["model.norm.weight"].copy()
    for own, target in (("embed_tokens.weight", "model.embed_tokens.weight"), ("shared_head.head.weight", "lm_head.weight")):
        w = t[target]
        t[m + own] = (w + 0.01 * w.std() * rng.standard_normal(w.shape)).astype(np.float32)
    return t


def config(n_dense: int = 1, intermediate_size: int = 128) -> dict:
    """CONFIG with `n_dense` dense layers (FFNs of `intermediate_size`) before the one MoE layer."""
    return CONFIG | dict(first_k_dense_replace=n_dense, num_hidden_layers=n_dense + 1,
                         intermediate_size=intermediate_size)


def write_checkpoint(d: Path, *, seed: int = 0, first_scale: float = 0.3, moe_scale: float = 1.0,
                     mtp_noise: float = 0.1, output_std: float = 0.5, n_dense: int = 1,
                     intermediate_size: int = 128) -> Path:
    """config.json, model.safetensors and the tokenizer files of the tiny GLM-4.5-style MoE + MTP in ``d``."""
    from safetensors.numpy import save_file

    cfg = config(n_dense, intermediate_size)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file(_tensors(cfg, seed, first_scale, moe_scale, mtp_noise, output_std), str(d / "model.safetensors"))
    write_glm_tokenizer(d)
    return d


def build_glm4moe_mtp(root: Path, **weights: float) -> tuple[Path, Path]:
    """Write the HF checkpoint under ``root/glm4moe-mtp-hf`` and convert it to ``root/glm4moe-mtp-f32.gguf``.

    ``weights``: write_checkpoint's keywords (seed, first_scale, moe_scale, mtp_noise, output_std)."""
    root = Path(root)
    hf = write_checkpoint(root / "glm4moe-mtp-hf", **weights)
    return hf, convert_hf(hf, root / "glm4moe-mtp-f32.gguf")


@pytest.fixture(scope="session")
def glm4moe_mtp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(hf_dir, gguf_path) of the tiny GLM-4.5-style MoE + MTP fixture, built once a session."""
    return build_glm4moe_mtp(tmp_path_factory.mktemp("glm4moe_mtp"))


@pytest.fixture(scope="session")
def glm4moe_mtp_agreeing(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(hf_dir, gguf_path) of the GLM fixture whose nextn head agrees with its trunk and costs little beside
    it (``AGREEING``): the one ``-k auto`` drafts on."""
    return build_glm4moe_mtp(tmp_path_factory.mktemp("glm4moe_mtp_agreeing"), **AGREEING)
