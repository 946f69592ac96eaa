"""z-lab DFlash v1 checkpoints converted by `edgespec convert --head` equal the reference forward
(z-lab/dflash dflash/model.py, ported to torch in tests/hf_head_fixtures.py): the converted GGUF
run by edgespec's numpy head and by libllama gives the port's block logits within 1e-4 of the logit
range, for blocks after two injections of context (a KV history). Bad inputs are one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_fixtures import build_tiny_llama
from head_oracles import DFlashHead
from hf_head_fixtures import (
    dflash_reference,
    export_dflash_zlab,
    hf_target_dir,
    llama_cpp_convert,
    random_weights,
    save_checkpoint,
    within_range,
)

import edgespec
from edgespec.drafters.dflash import DFlashDrafter
from edgespec.gguf_file import read_gguf
from edgespec.heads.convert import convert_head, is_head_checkpoint
from edgespec.heads.convert_dflash import z_lab_target_layer_ids
from edgespec.heads.dflash_gguf import read_dflash_gguf
from edgespec.heads.hf_checkpoint import CheckpointError

N_VOCAB, H, MASK = 49152, 64, 49151
CTX = (5, 3)  # context rows injected before the first and the second block


def _config(**extra) -> dict:
    """A qwen3-8b-dflash.json-shaped config (SpecForge configs/ and z-lab's releases), small."""
    return dict(architectures=["DFlashDraftModel"], model_type="qwen3", attention_bias=False, block_size=4,
                dflash_config={"mask_token_id": MASK, "target_layer_ids": [1, 4]}, head_dim=16, hidden_act="silu",
                hidden_size=H, intermediate_size=96, layer_types=["full_attention"] * 2, max_position_embeddings=4096,
                num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2, num_target_layers=8,
                rms_norm_eps=1e-6, rope_scaling=None, rope_theta=1000000, sliding_window=None,
                tie_word_embeddings=False, use_sliding_window=False, vocab_size=N_VOCAB, dtype="bfloat16") | extra


def _shapes(prefix: str = "") -> dict[str, tuple[int, ...]]:
    s = {"fc.weight": (H, 2 * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(2):
        p = f"layers.{i}."
        s |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
              p + "self_attn.q_proj.weight": (64, H), p + "self_attn.k_proj.weight": (32, H),
              p + "self_attn.v_proj.weight": (32, H), p + "self_attn.o_proj.weight": (H, 64),
              p + "self_attn.q_norm.weight": (16,), p + "self_attn.k_norm.weight": (16,),
              p + "mlp.gate_proj.weight": (96, H), p + "mlp.up_proj.weight": (96, H), p + "mlp.down_proj.weight": (H, 96)}
    return {prefix + k: v for k, v in s.items()}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    """An 8-layer F32 tiny llama (n_embd 64), its token embeddings and LM head."""
    path = build_tiny_llama(tmp_path_factory.mktemp("cvd") / "tiny8.gguf", vocab_source=smollm2_path, n_layer=8)
    f = read_gguf(path)
    return path, f.tensor("token_embd.weight"), f.tensor("output.weight")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict, dict]:
    d = tmp_path_factory.mktemp("dfl")
    cfg, w = _config(), random_weights(_shapes(), "bf16", seed=3)
    return save_checkpoint(d / "zlab", cfg, w, shards=2), cfg, w


def test_z_lab_default_layers():
    """build_target_layer_ids of z-lab's model.py: the middle layer, else evenly spaced over 1..N−3."""
    assert z_lab_target_layer_ids(36, 1) == [18]
    assert z_lab_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # qwen3-8b-dflash.json's ids
    assert z_lab_target_layer_ids(8, 2) == [1, 5]


@pytest.mark.real
def test_converted_head_equals_the_reference_forward(checkpoint, target, tmp_path: Path):
    from edgespec.backends.llama_cpp import LlamaCppBackend
    from edgespec.heads.dflash_llama import LlamaDFlashHead

    ckpt, cfg, w = checkpoint
    out = convert_head(ckpt, target[0], tmp_path / "dflash.gguf", outtype="f32")
    config, tensors = read_dflash_gguf(out)
    assert config.target_layers == (2, 5) and config.block_size == 4 and config.mask_token_id == MASK
    assert not config.causal and "token_embd.weight" not in tensors and "output.weight" not in tensors
    rng = np.random.default_rng(1)
    ctx = rng.standard_normal((sum(CTX), 2 * H)).astype(np.float32) * 2
    blocks = [[int(rng.integers(N_VOCAB))] + [MASK] * 3, [int(rng.integers(N_VOCAB))] + [MASK] * 2]
    refs = [dflash_reference(w, cfg, ctx[:CTX[0]], blocks[0], target[1], target[2]),
            dflash_reference(w, cfg, ctx, blocks[1], target[1], target[2])]
    numpy_head = DFlashHead(config, tensors, tok_embd=target[1], output=target[2])
    with LlamaCppBackend(target[0], n_ctx=64, threads=1) as tgt, \
            LlamaDFlashHead(out, tgt, kv_type="f32", flash_attn=False, threads=1) as ll_head:
        for head in (numpy_head, ll_head):
            head.inject(ctx[:CTX[0]])
            within_range(head.block_logits(blocks[0]), refs[0])
            head.inject(ctx[CTX[0]:])
            within_range(head.block_logits(blocks[1]), refs[1])


def _variant(src: tuple[Path, dict, dict], d: Path, config=None, drop=(), add=None) -> Path:
    _, cfg, w = src
    cfg = cfg | (config or {})
    return save_checkpoint(d, {k: v for k, v in cfg.items() if v is not None},
                           {k: v for k, v in w.items() if k not in drop} | (add or {}))


@pytest.mark.real
def test_default_layers_prefix_and_own_embeddings(checkpoint, target, tmp_path: Path):
    """No target_layer_ids: z-lab's defaults (+1); a model. prefix; an embed_tokens copy is dropped."""
    ckpt, cfg, w = checkpoint
    w2 = {"model." + k: v for k, v in w.items()} | {"model.embed_tokens.weight": torch.from_numpy(target[1])}
    d = save_checkpoint(tmp_path / "v", cfg | {"dflash_config": {"mask_token_id": MASK}}, w2)
    lines: list[str] = []
    config, tensors = read_dflash_gguf(convert_head(d, target[0], tmp_path / "v.gguf", outtype="f32", note=lines.append))
    assert config.target_layers == (2, 6) and "token_embd.weight" not in tensors
    assert any("copy of the target's token embeddings" in line for line in lines)


@pytest.mark.real
@pytest.mark.parametrize("edit, message", [
    (dict(config={"vocab_size": 32000}), "vocabulary of 32000 tokens"),
    (dict(config={"dflash_config": {"mask_token_id": MASK, "target_layer_ids": [1, 7]}}), "outputs of target layers [1, 7]"),
    (dict(config={"num_target_layers": 36}), "made for a target of 36 layers"),
    (dict(config={"dflash_config": {"target_layer_ids": [1, 4]}}), "lacks dflash_config.mask_token_id"),
    (dict(config={"architectures": ["DFlash2DraftModel"]}), "DFlash2 (conv kernels, candidate selector)"),
    (dict(config={"dflash_config": {"mask_token_id": MASK, "conv_kernel_size": 4}}), "DFlash2"),
    (dict(config={"use_sliding_window": True}), "sliding-window attention"),
    (dict(config={"attention_bias": True}), "biases"),
    (dict(config={"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}), "RoPE scaling 'yarn'"),
    (dict(drop=["layers.1.self_attn.k_norm.weight"]), "lacks DFlash tensors: blk.1.attn_k_norm.weight"),
    (dict(add={"layers.2.input_layernorm.weight": torch.ones(H)}), "does not have: layers.2.input_layernorm.weight"),
    (dict(add={"fc.weight": torch.zeros(H, 3 * H)}), "fc.weight has shape [64, 192], expected [64, 128]"),
    (dict(add={"embed_tokens.weight": torch.zeros(N_VOCAB, H)}), "own embed_tokens but no lm_head"),
    (dict(add={"lm_head.weight": torch.zeros(100, H)}), "no d2t"),
    (dict(config={"num_attention_heads": 3}), "cannot convert"),
])
def test_bad_checkpoints_are_one_line_errors(checkpoint, target, tmp_path: Path, edit: dict, message: str):
    bad = _variant(checkpoint, tmp_path / "bad", **edit)
    with pytest.raises(CheckpointError) as err:
        convert_head(bad, target[0], tmp_path / "out.gguf")
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.real
def test_hidden_size_must_be_the_targets(checkpoint, tmp_path: Path, smollm2_path: Path):
    narrow = build_tiny_llama(tmp_path / "narrow.gguf", vocab_source=smollm2_path, n_layer=8, n_embd=32)
    with pytest.raises(CheckpointError, match="hidden size 64, but target .* has hidden size 32"):
        convert_head(checkpoint[0], narrow, tmp_path / "out.gguf")


def test_head_directories_are_recognised(checkpoint, tmp_path: Path):
    assert is_head_checkpoint(checkpoint[0])
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30}))
    assert not is_head_checkpoint(tmp_path)  # an mlx-lm / HF model directory is no head
    assert not is_head_checkpoint(tmp_path / "missing")


@pytest.mark.real
def test_drafter_head_dir_on_smollm2_is_lossless(smollm2_path, tmp_path, monkeypatch, capfd):
    """The shipped SmolLM2 DFlash head written as a z-lab checkpoint, used as `--drafter DIR`."""
    shipped = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-dflash.gguf"
    published = export_dflash_zlab(shipped, tmp_path / "pub")
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    with edgespec.load(smollm2_path, drafter=published, n_ctx=512, threads=1, num_draft=3) as engine:
        assert isinstance(engine.drafter, DFlashDrafter)
        for prompt in ["The capital of France is", "def fibonacci(n):"]:
            plain = engine.generate(prompt, max_tokens=32, speculative=False)
            assert engine.generate(prompt, max_tokens=32).tokens == plain.tokens, prompt
    assert "converting the head" in capfd.readouterr().err
    (cached,) = (tmp_path / "home" / "heads").glob("*.gguf")
    c0, t0 = read_dflash_gguf(shipped)
    c1, t1 = read_dflash_gguf(cached)
    assert c1 == c0 and all(np.array_equal(t1[k], t0[k]) for k in t0) and t1.keys() == t0.keys()


@pytest.mark.real
def test_same_gguf_as_llama_cpps_converter(checkpoint, target, tmp_path: Path):
    """The vendored llama.cpp converter (convert_hf_to_gguf.py, conversion/qwen.py DFlashModel) on the
    same checkpoint writes the same tensors (bit for bit in F32) and the same dflash.* values."""
    target_dir = hf_target_dir(tmp_path / "target", n_layer=8, n_embd=H, n_vocab=N_VOCAB)
    theirs = read_gguf(llama_cpp_convert(checkpoint[0], target_dir, tmp_path / "llama_cpp.gguf"))
    ours = read_gguf(convert_head(checkpoint[0], target[0], tmp_path / "ours.gguf", outtype="f32"))
    assert set(theirs.tensors) == set(ours.tensors)
    for name in ours.tensors:
        np.testing.assert_array_equal(ours.tensor(name), theirs.tensor(name), err_msg=name)
    shared = sorted(k for k in ours.kv if k.startswith("dflash.") and k in theirs.kv)
    assert {"dflash.target_layers", "dflash.block_size", "dflash.embedding_length"} <= set(shared)
    for key in [*shared, "tokenizer.ggml.mask_token_id"]:
        assert ours.value(key) == pytest.approx(theirs.value(key)), key


@pytest.mark.real
def test_cli_drafter_dir_refused_in_one_line(checkpoint, target, tmp_path: Path, monkeypatch):
    from typer.testing import CliRunner

    from edgespec.cli import app as cli

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    bad = _variant(checkpoint, tmp_path / "dflash2", config={"architectures": ["DFlash2DraftModel"]})
    result = CliRunner().invoke(cli.app, ["generate", "--target", str(target[0]), "--drafter", str(bad), "-p", "Hi",
                                          "-n", "4"])
    assert result.exit_code != 0
    lines = [ln for ln in result.output.splitlines() if "DFlash2" in ln]
    assert len(lines) == 1 and "not supported" in lines[0], result.output
