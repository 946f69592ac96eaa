"""Medusa heads in the published layout (config.json + medusa_lm_head.safetensors) converted by
`convert_head` equal an independent torch port of upstream's forward (tests/medusa_reference.py)
within 1e-4 of the logit range; the GGUF round trip keeps them; every bad input is a one-line error."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from medusa_reference import WEIGHTS, reference_logits, write_checkpoint

from edgespec.gguf_file import read_gguf
from edgespec.heads.convert import convert_head, head_layout, is_head_checkpoint
from edgespec.heads.convert_medusa import convert_medusa
from edgespec.heads.hf_checkpoint import CheckpointError, read_checkpoint
from edgespec.heads.medusa import MedusaConfig, MedusaHead, read_medusa_gguf, write_medusa_gguf

H, V, K = 64, 300, 3


def within_range(got: np.ndarray, ref: np.ndarray, rel: float) -> float:
    span = float(ref.max() - ref.min())
    diff = float(np.abs(got - ref).max()) / span
    assert diff <= rel, diff
    return diff


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A target GGUF header: hidden size H, 2 layers, a V-token vocabulary (no weights: none are read)."""
    path = tmp_path_factory.mktemp("target") / "target.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_embedding_length(H)
    w.add_block_count(2)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(V)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _hidden(n: int = 7, seed: int = 1) -> np.ndarray:
    """Last hidden states after a final RMSNorm with a non-trivial weight, as a target hands them over."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, H))
    return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True)) * rng.uniform(0.5, 2.0, H)).astype(np.float32)


CASES = {  # name: (layers, own output, untied, checkpoint dtype)
    "1-layer": (1, True, False, "fp32"),
    "2-layer": (2, True, False, "fp32"),  # upstream's [ResBlock] * 2: one block applied twice
    "2-layer-untied": (2, True, True, "bf16"),
    "shared-lm-head": (1, False, False, "fp16"),  # config version 2
}


@pytest.mark.parametrize("case", CASES)
def test_converted_heads_equal_the_reference_forward(target: Path, tmp_path: Path, case: str):
    n_layers, own, untied, dtype = CASES[case]
    d = write_checkpoint(tmp_path / case, K, n_layers, H, V, own_output=own, untied=untied, dtype=dtype,
                         seed=3)
    assert head_layout(json.loads((d / "config.json").read_text())) == ("medusa", "Medusa")
    assert is_head_checkpoint(d)  # `--drafter DIR` converts it (tests/test_medusa_drafter.py runs one)
    lines: list[str] = []
    out = convert_head(d, target, tmp_path / "medusa.gguf", outtype="f32", note=lines.append)
    assert any(f"{K} Medusa heads of {n_layers} residual" in line and "trained on tiny/target" in line
               for line in lines), lines
    config, tensors = read_medusa_gguf(out)
    assert config == MedusaConfig(K, n_layers, H, V, shared_lm_head=not own)
    lm_head = np.random.default_rng(5).standard_normal((V, H)).astype(np.float32) / 8 if not own else None
    h = _hidden()
    ref = reference_logits(d, h, lm_head=lm_head, untied=untied)
    got = MedusaHead(config, tensors, lm_head=lm_head).logits(h)
    assert got.shape == ref.shape == (K, len(h), V)
    within_range(got, ref, 1e-4)
    if not untied and n_layers == 2:  # upstream's tied blocks: not the same as one block
        one = MedusaHead(MedusaConfig(K, 1, H, V), {n: t for n, t in tensors.items() if ".res.1." not in n})
        assert np.abs(one.logits(h) - ref).max() > 1e-2 * (ref.max() - ref.min())
    meta = read_gguf(out, with_tensors=False)
    assert meta.value("edgespec.head.base_model") == "tiny/target"
    assert len(meta.value("tokenizer.ggml.tokens")) == V


def test_f16_and_f32_round_trips(tmp_path: Path):
    d = write_checkpoint(tmp_path / "ckpt", K, 2, H, V, untied=True, seed=4)
    config, tensors = convert_medusa(read_checkpoint(d))  # no target: the checkpoint alone
    f32 = write_medusa_gguf(tmp_path / "32.gguf", config, tensors, weight_type="f32")
    c32, t32 = read_medusa_gguf(f32)
    assert c32 == config and all(np.array_equal(t32[n], tensors[n]) for n in tensors)
    c16, t16 = read_medusa_gguf(write_medusa_gguf(tmp_path / "16.gguf", config, tensors))
    meta = read_gguf(tmp_path / "16.gguf", with_tensors=True)
    assert meta.tensors["blk.0.res.0.weight"][0] == gguf.GGMLQuantizationType.F16
    assert meta.tensors["blk.0.res.0.bias"][0] == gguf.GGMLQuantizationType.F32
    assert meta.value("medusa.num_heads") == K and meta.value("medusa.shared_lm_head") is False
    h = _hidden(seed=2)
    ref = reference_logits(d, h, untied=True)
    within_range(MedusaHead(c16, t16).logits(h), ref, 2e-3)  # F16 weights: ~2⁻¹¹ relative rounding


def test_shared_heads_need_the_target_lm_head(tmp_path: Path):
    config = MedusaConfig(2, 1, H, V, shared_lm_head=True)
    tensors = {n: np.zeros(s, np.float32) for n, s in config.shapes().items()}
    assert set(tensors) == {f"blk.{k}.res.0.{p}" for k in range(2) for p in ("weight", "bias")}
    with pytest.raises(ValueError, match=r"need it as a \(300, 64\) matrix"):
        MedusaHead(config, tensors)
    with pytest.raises(ValueError, match="lack tensor blk.1.res.0.bias"):
        MedusaHead(config, {n: t for n, t in tensors.items() if n != "blk.1.res.0.bias"}, np.zeros((V, H)))
    with pytest.raises(ValueError, match="not a Medusa head file"):
        read_medusa_gguf(_other_arch(tmp_path / "x.gguf"))


def _other_arch(path: Path) -> Path:
    w = gguf.GGUFWriter(path, "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _edit(src: Path, dst: Path, config: dict | None = None, drop=(), add=None) -> Path:
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text()) | (config or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    w = {k: v for k, v in load_file(str(src / WEIGHTS)).items() if k not in drop} | (add or {})
    save_file(w, str(dst / WEIGHTS))
    return dst


@pytest.mark.parametrize("edit, message", [
    (dict(drop=["1.0.linear.bias"]), "lacks the Medusa tensor 1.0.linear.bias"),
    (dict(drop=["2.1.weight"]), "lacks the Medusa tensor 2.1.weight (head 2's output matrix"),
    (dict(add={"0.0.linear.scale": torch.zeros(H)}), "does not have: 0.0.linear.scale"),
    (dict(config={"medusa_num_layers": 2}),
     "medusa_num_layers=2 does not have: 0.1.weight, 1.1.weight, 2.1.weight"),
    (dict(add={"1.1.weight": torch.zeros(V, 32)}), "1.1.weight has shape [300, 32], expected [300, 64]"),
    (dict(add={"1.0.linear.weight": torch.zeros(H, 32)}),
     "1.0.linear.weight has shape [64, 32], expected [64, 64]"),
    (dict(add={"0.0.linear.weight": torch.zeros(H, 32)}), "has hidden size 32, but target"),
    (dict(add={f"{k}.1.weight": torch.zeros(200, H) for k in range(K)}),
     "a vocabulary of 200 tokens, but target"),
    (dict(config={"hidden_size": 128}), "hidden size 64, but config.json says hidden_size=128"),
    (dict(config={"version": "2"}),
     "version 2 (heads share the target's LM head) but the weights hold output"),
    (dict(config={"medusa_num_layers": "one"}), "medusa_num_layers must be a non-negative integer"),
    (dict(drop=[f"{k}.{p}" for k in range(K) for p in ("0.linear.weight", "0.linear.bias", "1.weight")]),
     "holds no Medusa head tensors"),
])
def test_bad_checkpoints_are_one_line_errors(target: Path, tmp_path: Path, edit: dict, message: str):
    src = write_checkpoint(tmp_path / "good", K, 1, H, V)
    bad = _edit(src, tmp_path / "bad", **edit)
    with pytest.raises(CheckpointError) as err:
        convert_head(bad, target, tmp_path / "out.gguf")
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "out.gguf").exists()


def test_missing_files_and_other_targets_are_one_line_errors(target: Path, tmp_path: Path):
    src = write_checkpoint(tmp_path / "good", K, 1, H, V)
    for gone, message in (("config.json", "no config.json"), (WEIGHTS, "no *.safetensors weights")):
        d = _edit(src, tmp_path / f"no-{gone}")
        (d / gone).unlink()
        with pytest.raises(CheckpointError, match=message.replace("*", r"\*")) as err:
            convert_head(d, target, tmp_path / "out.gguf")
        assert "\n" not in str(err.value)
    d = _edit(src, tmp_path / "pickled")
    (d / WEIGHTS).rename(d / "medusa_lm_head.pt")  # upstream's other file name: a pickle, never opened
    with pytest.raises(CheckpointError, match=r"pickle weights \(medusa_lm_head.pt\).*never unpickles"):
        convert_head(d, target, tmp_path / "out.gguf")
    wide = write_checkpoint(tmp_path / "wide", K, 1, 2 * H, V)
    with pytest.raises(CheckpointError, match="has hidden size 128, but target .* has hidden size 64"):
        convert_head(wide, target, tmp_path / "out.gguf")
    shared = write_checkpoint(tmp_path / "shared", K, 1, H, V, own_output=False)
    with pytest.raises(CheckpointError, match="take their vocabulary size from the target"):
        convert_medusa(read_checkpoint(shared))
    assert not (tmp_path / "out.gguf").exists()


def test_head_count_comes_from_the_weights(target: Path, tmp_path: Path):
    """Upstream's published configs can name fewer heads than the file holds (its loader forces 5)."""
    src = write_checkpoint(tmp_path / "good", K, 1, H, V)
    d = _edit(src, tmp_path / "two", config={"medusa_num_heads": 2})
    lines: list[str] = []
    out = convert_head(d, target, tmp_path / "o.gguf", outtype="f32", note=lines.append)
    config, _ = read_medusa_gguf(out)
    assert config.n_heads == K
    assert any("medusa_num_heads=2, the weights hold 3 heads" in line for line in lines), lines
