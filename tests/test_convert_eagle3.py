"""Published EAGLE-3 checkpoints (EAGLE traineagle3, SpecForge, speculators) converted by
`edgespec convert --head` equal the reference forward: the converted GGUF, run by edgespec's numpy
head and by libllama, gives the logits of an independent torch port of each layout's upstream
forward (tests/hf_head_fixtures.py) within 1e-4 of the logit range, over positions with a KV
history. Every bad input is a one-line error."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_fixtures import build_tiny_llama
from hf_head_fixtures import (
    eagle3_reference,
    export_eagle3_speculators,
    hf_target_dir,
    llama_cpp_convert,
    random_weights,
    save_checkpoint,
    within_range,
)
from typer.testing import CliRunner

import edgespec
from edgespec.cli import app as cli
from edgespec.drafters.eagle import EagleDrafter
from edgespec.gguf_file import read_gguf
from edgespec.heads.convert import convert_head
from edgespec.heads.eagle3 import Eagle3Head
from edgespec.heads.gguf_io import read_eagle3_gguf
from edgespec.heads.hf_checkpoint import CheckpointError

N_VOCAB, N_DRAFT, H_T = 49152, 512, 64  # SmolLM2's tokenizer; the tiny target's hidden size
CHUNKS = (4, 1, 3)  # decode calls: a prefill, a single step, a few more (KV history)


# llama3 RoPE scaling as Llama-3.1 heads have it (SpecForge configs/llama3-70B-ealge3.json), with an
# original context small enough that the tiny heads' pairs fall in all three bands (1, smoothed, factor)
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=256)


def _config(case: str, H: int) -> dict:
    layout = case.split("-")[0]
    cfg = _layout_config(layout, H)
    if case == "SpecForge-llama3":  # transformers v4's name, at the top level
        cfg["rope_scaling"] = dict(LLAMA3)
    elif case == "speculators-llama3":  # transformers v5's rope_parameters (rope_theta inside), nested
        tl = cfg["transformer_layer_config"]
        tl["rope_parameters"] = LLAMA3 | {"rope_theta": tl.pop("rope_theta")}
    return cfg


def _layout_config(layout: str, H: int) -> dict:
    base = dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                num_hidden_layers=1, rms_norm_eps=1e-5, vocab_size=N_VOCAB, hidden_act="silu",
                max_position_embeddings=2048)
    if layout == "EAGLE":  # eagle/traineagle3/config.json: a LlamaForCausalLM with draft_vocab_size
        return dict(architectures=["LlamaForCausalLM"], model_type="llama", draft_vocab_size=N_DRAFT,
                    torch_dtype="float32", **base)
    if layout == "SpecForge":
        return dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", draft_vocab_size=N_DRAFT,
                    target_hidden_size=H_T, rope_theta=500000.0, rope_scaling=None, torch_dtype="bfloat16", **base)
    return dict(architectures=["Eagle3Speculator"], speculators_model_type="eagle3", draft_vocab_size=N_DRAFT,
                norm_before_residual=True, norm_before_fc=True, eagle_aux_hidden_state_layer_ids=[1, 3, 6],
                transformer_layer_config=dict(model_type="llama", rope_theta=1000000.0, **base))


def _shapes(layout: str, H: int, embed: bool) -> dict[str, tuple[int, ...]]:
    p = "layers.0." if layout == "speculators" else "midlayer."
    hd = H // 4
    s = {"fc.weight": (H, 3 * H_T), p + "hidden_norm.weight": (H,), p + "input_layernorm.weight": (H,),
         p + "self_attn.q_proj.weight": (4 * hd, 2 * H), p + "self_attn.k_proj.weight": (2 * hd, 2 * H),
         p + "self_attn.v_proj.weight": (2 * hd, 2 * H), p + "self_attn.o_proj.weight": (H, 4 * hd),
         p + "post_attention_layernorm.weight": (H,), p + "mlp.gate_proj.weight": (96, H),
         p + "mlp.up_proj.weight": (96, H), p + "mlp.down_proj.weight": (H, 96), "norm.weight": (H,),
         "lm_head.weight": (N_DRAFT, H)}
    if layout == "speculators":
        s["input_norm.weight"] = (3 * H_T,)
    if embed:
        s["embed_tokens.weight"] = (N_VOCAB, H)
    return s


# case → (dtype, head hidden size, embed_tokens: "copy" of the target's / "own" / None, shards); a case
# is a layout, "-llama3" when its config has llama3 RoPE scaling
LAYOUTS = {"EAGLE": ("fp32", 64, "copy", 1), "SpecForge": ("bf16", 32, "own", 2), "speculators": ("fp16", 64, None, 1),
           "SpecForge-llama3": ("bf16", 32, "own", 1), "speculators-llama3": ("fp16", 64, None, 1)}


def make_checkpoint(d: Path, case: str, target_embd: np.ndarray, seed: int = 0) -> tuple[Path, dict, dict]:
    """A checkpoint of `case` with random weights, real names/config fields/dtypes; d2t offsets."""
    dtype, H, embed, shards = LAYOUTS[case]
    cfg = _config(case, H)
    w = random_weights(_shapes(case.split("-")[0], H, embed == "own"), dtype, seed)
    if embed == "copy":
        w["embed_tokens.weight"] = torch.from_numpy(target_embd.copy())
    used = np.sort(np.random.default_rng(seed).choice(N_VOCAB, N_DRAFT, replace=False))
    w["d2t"] = torch.from_numpy(used - np.arange(N_DRAFT))  # EAGLE's offsets
    w["t2d"] = torch.from_numpy(np.isin(np.arange(N_VOCAB), used))
    return save_checkpoint(d, cfg, w, shards), cfg, w


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> tuple[Path, np.ndarray]:
    """An 8-layer F32 tiny llama (n_embd 64) with SmolLM2's tokenizer, and its token embeddings."""
    path = build_tiny_llama(tmp_path_factory.mktemp("cv3") / "tiny8.gguf", vocab_source=smollm2_path, n_layer=8)
    return path, read_gguf(path).tensor("token_embd.weight")


@pytest.fixture(scope="module")
def converted(tmp_path_factory, target) -> dict[str, tuple[Path, dict, dict, Path]]:
    """layout → (checkpoint dir, config, tensors, converted F32 GGUF)."""
    d, out = tmp_path_factory.mktemp("ckpt"), {}
    for i, layout in enumerate(LAYOUTS):
        ckpt, cfg, w = make_checkpoint(d / layout, layout, target[1], seed=i)
        out[layout] = (ckpt, cfg, w, convert_head(ckpt, target[0], d / f"{layout}.gguf", outtype="f32"))
    return out


def _pairs(seed: int = 7) -> tuple[np.ndarray, list[int]]:
    rng = np.random.default_rng(seed)
    n = sum(CHUNKS)
    return rng.standard_normal((n, 3 * H_T)).astype(np.float32) * 2, [int(t) for t in rng.integers(0, N_VOCAB, n)]


def _run(head, feats: np.ndarray, tokens: list[int]) -> np.ndarray:
    """The head over the pairs in CHUNKS decode calls, each appended to its KV cache."""
    g, rows, at = head.encode(feats), [], 0
    for n in CHUNKS:
        rows.append(head.decode(tokens[at:at + n], g[at:at + n])[0])
        at += n
    return np.concatenate(rows)


def _without_rope_scaling(cfg: dict) -> dict:
    """``cfg`` with its RoPE scaling dropped (rope_theta kept)."""
    tl = dict(cfg.get("transformer_layer_config", {}))
    theta = (tl.pop("rope_parameters", None) or {}).get("rope_theta")
    plain = {k: v for k, v in cfg.items() if k != "rope_scaling"}
    return plain | ({"transformer_layer_config": tl | {"rope_theta": theta}} if tl else {})


@pytest.mark.real
@pytest.mark.parametrize("case", list(LAYOUTS))
def test_converted_head_equals_the_reference_forward(converted, target, case: str):
    from edgespec.backends.llama_cpp import LlamaCppBackend
    from edgespec.heads.eagle3_llama import LlamaEagle3Head

    ckpt, cfg, w, gguf_path = converted[case]
    layout = case.split("-")[0]
    feats, tokens = _pairs()
    embed = w["embed_tokens.weight"].to(torch.float32).numpy() if "embed_tokens.weight" in w else target[1]
    ref = eagle3_reference(w, cfg, feats, tokens, embed, N_VOCAB)
    config, tensors = read_eagle3_gguf(gguf_path)
    assert config.target_layers == ((1, 3, 6) if layout == "speculators" else (2, 4, 5))  # EAGLE's (2, N//2, N-3)
    assert config.norm_before_fc == (layout == "speculators") and config.n_draft_vocab == N_DRAFT
    assert ("token_embd.weight" in tensors) == (LAYOUTS[case][2] == "own")  # a copy of the target's is dropped
    assert ("rope_freqs.weight" in tensors) == case.endswith("-llama3")
    if case.endswith("-llama3"):  # the scaling matters at these positions: the test can tell
        ff = tensors["rope_freqs.weight"]
        assert ff[0] == 1.0 and ff[-1] == 8.0 and np.any((ff > 1) & (ff < 8))
        with pytest.raises(AssertionError):
            within_range(eagle3_reference(w, _without_rope_scaling(cfg), feats, tokens, embed, N_VOCAB), ref, 1e-3)
    within_range(_run(Eagle3Head(config, tensors, tok_embd=target[1]), feats, tokens), ref)
    if importlib.util.find_spec("mlx") is not None:
        from edgespec.heads.eagle3_mlx import MlxEagle3Head

        within_range(_run(MlxEagle3Head(config, tensors, tok_embd=target[1]), feats, tokens), ref)
    with LlamaCppBackend(target[0], n_ctx=64, threads=1) as tgt, \
            LlamaEagle3Head(gguf_path, tgt, kv_type="f32", flash_attn=False, threads=1) as head:
        within_range(_run(head, feats, tokens), ref)


@pytest.mark.real
def test_cli_convert_head_f16(converted, target, tmp_path: Path):
    ckpt = converted["speculators"][0]
    out = tmp_path / "head.gguf"
    result = CliRunner().invoke(cli.app, ["convert", "--head", str(ckpt), "--target", str(target[0]),
                                          "--out", str(out), "--outtype", "f16"])
    assert result.exit_code == 0, result.output
    f = read_gguf(out)
    assert f.value("general.architecture") == "eagle3" and f.value("eagle3.norm_before_fc") is True
    assert f.tensors["blk.0.attn_q.weight"][0].name == "F16" and f.tensors["d2t"][0].name == "I64"
    assert f.value("edgespec.head.layout") == "speculators"
    result = CliRunner().invoke(cli.app, ["convert", "--head", str(ckpt), "--out", str(out)])
    assert result.exit_code == 1 and "needs --target" in result.output


# -- bad inputs: one line each ------------------------------------------------------------------------


def _edit(src: Path, dst: Path, config=None, tl=None, drop=(), add=None, rename=None) -> Path:
    """A copy of checkpoint `src` with its config (and transformer_layer_config) updated and
    tensors dropped/added/renamed."""
    from safetensors.torch import load_file

    cfg = json.loads((src / "config.json").read_text()) | (config or {})
    if tl:
        cfg["transformer_layer_config"] = cfg["transformer_layer_config"] | tl
    w = {}
    for f in sorted(src.glob("*.safetensors")):
        w |= load_file(str(f))
    w = {(rename or {}).get(k, k): v for k, v in w.items() if k not in drop} | (add or {})
    return save_checkpoint(dst, cfg, w)


@pytest.mark.real
@pytest.mark.parametrize("edit, message", [
    (dict(config={"target_hidden_size": 128}), "made for a target of hidden size 128"),
    (dict(tl={"vocab_size": 32000}), "vocabulary of 32000 tokens"),
    (dict(config={"eagle_aux_hidden_state_layer_ids": [2, 4, 8]}), "reads target layers (2, 4, 8)"),
    (dict(config={"eagle_aux_hidden_state_layer_ids": [2, 4]}), "names 2 layers"),
    (dict(drop=["layers.0.mlp.up_proj.weight"]), "lacks the EAGLE-3 tensor for blk.0.ffn_up.weight"),
    (dict(add={"layers.0.self_attn.q_proj.bias": torch.zeros(64)}), "does not have: layers.0.self_attn.q_proj.bias"),
    (dict(add={"lm_head.weight": torch.zeros(N_DRAFT, 48)}), "lm_head.weight has shape [512, 48]"),
    (dict(config={"norm_output": True}), "norm_output=True"),
    (dict(config={"fc_norm": True}), "fc_norm"),
    (dict(config={"norm_before_fc": False}), "norm_before_fc is False but input_norm.weight is present"),
    (dict(drop=["d2t"]), "no d2t"),
    (dict(add={"d2t": torch.zeros(N_DRAFT, dtype=torch.int64) + 49000}), "distinct target ids"),
    (dict(tl={"model_type": "qwen3"}), "'qwen3' decoder layer"),
    (dict(tl={"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}), "RoPE scaling 'yarn'"),
    (dict(tl={"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}), "RoPE scaling 'dynamic'"),
    (dict(tl={"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}), "llama3 RoPE scaling lacks low_freq_factor"),
    (dict(tl={"partial_rotary_factor": 0.5}), "partial rotary embeddings"),
    (dict(config={"architectures": ["MistralForCausalLM"], "speculators_model_type": None}), "unknown head layout"),
])
def test_bad_checkpoints_are_one_line_errors(converted, target, tmp_path: Path, edit: dict, message: str):
    bad = _edit(converted["speculators"][0], tmp_path / "bad", **edit)
    with pytest.raises(CheckpointError) as err:
        convert_head(bad, target[0], tmp_path / "out.gguf")
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "out.gguf").exists()


@pytest.mark.real
def test_hidden_size_without_embeddings_and_default_layers_checked(converted, target, tmp_path: Path):
    src = converted["SpecForge"][0]  # H 32 with its own embed_tokens
    bad = _edit(src, tmp_path / "noemb", drop=["embed_tokens.weight"])
    with pytest.raises(CheckpointError, match="can borrow the target's embeddings only if"):
        convert_head(bad, target[0], tmp_path / "o.gguf")
    small = build_tiny_llama(tmp_path / "tiny2.gguf", vocab_source=target[0], n_layer=2)
    with pytest.raises(CheckpointError, match=r"target layers \(2, 1, -1\).* has 2 layers"):
        convert_head(src, small, tmp_path / "o.gguf")


def test_pickles_and_odd_files_are_refused(tmp_path: Path):
    d = tmp_path / "pickled"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not unpickled")
    with pytest.raises(CheckpointError, match="never unpickles") as err:
        convert_head(d, "unused.gguf", tmp_path / "o.gguf")
    assert "pytorch_model.bin" in str(err.value)
    with pytest.raises(CheckpointError, match="no config.json"):
        convert_head(tmp_path, "unused.gguf", tmp_path / "o.gguf")
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        convert_head(d, "unused.gguf", tmp_path / "o.gguf")
    from safetensors.torch import save_file

    save_file({"fc.weight": torch.zeros(2, 2, dtype=torch.float8_e4m3fn)}, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="dtype F8_E4M3"):
        convert_head(d, "unused.gguf", tmp_path / "o.gguf")
    save_file({"fc.weight": torch.zeros(4, 4)}, str(d / "model.safetensors"))
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-2])
    with pytest.raises(CheckpointError, match="truncated"):
        convert_head(d, "unused.gguf", tmp_path / "o.gguf")


# -- `--drafter HEAD_DIR` on SmolLM2: the shipped head, published in speculators' layout -----------------

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-eagle3.gguf"
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_eagle3_speculators(SHIPPED, tmp_path_factory.mktemp("pub") / "smollm2-eagle3")


@pytest.mark.real
def test_drafter_head_dir_is_converted_once_and_stays_lossless(smollm2_path, published, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    with edgespec.load(smollm2_path, drafter=published, n_ctx=512, threads=1, num_draft=3) as engine:
        assert isinstance(engine.drafter, EagleDrafter)
        accepted = 0
        for prompt in PROMPTS:
            plain = engine.generate(prompt, max_tokens=32, speculative=False)
            spec = engine.generate(prompt, max_tokens=32)
            assert spec.tokens == plain.tokens, prompt
            accepted += spec.stats.n_accepted
        assert accepted > 0  # the shipped head, converted back, still drafts well
    err = capfd.readouterr().err
    assert "converting the head" in err and "cached in" in err
    (cached,) = (tmp_path / "heads").glob("*.gguf")
    c0, t0 = read_eagle3_gguf(SHIPPED)
    c1, t1 = read_eagle3_gguf(cached)
    assert c1 == c0 and t1.keys() == t0.keys()  # the round trip is exact (F16 values, absolute d2t)
    assert all(np.array_equal(t1[k], t0[k]) for k in t0)
    with edgespec.load(smollm2_path, drafter=published, n_ctx=512, threads=1) as engine:
        assert isinstance(engine.drafter, EagleDrafter)
    assert "converting" not in capfd.readouterr().err  # cached by content


@pytest.mark.real
@pytest.mark.slow
def test_sampling_with_a_converted_head_matches_plain(smollm2_path, published, smollm2_plain_counts, tmp_path,
                                                     monkeypatch):
    """test_real_sampling.py's chi-square test of homogeneity (first two tokens, N_RUNS seeded runs
    each) with the converted head drafting: spec sampling has the target's distribution. The plain
    side is the session's (conftest.py), the same runs test_real_sampling.py compares against."""
    from test_real_sampling import ALPHA, N_RUNS, homogeneity_p, run_many

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    plain = smollm2_plain_counts
    with edgespec.load(smollm2_path, drafter=published, n_ctx=256, threads=1, num_draft=3) as engine:
        spec, stats = run_many(engine, range(N_RUNS))
    drafted, accepted = sum(s.n_drafted for s in stats), sum(s.n_accepted for s in stats)
    assert 0 < accepted < drafted  # both branches: accepted drafts and residual samples
    p, cells = homogeneity_p(spec, plain)
    assert p > ALPHA, (p, cells)


@pytest.mark.real
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_same_gguf_as_llama_cpps_converter(converted, tmp_path: Path, layout: str):
    """The vendored llama.cpp converter (convert_hf_to_gguf.py, conversion/llama.py) on the same
    checkpoint writes the same tensors (bit for bit in F32, llama3's rope_freqs.weight included) and
    the same eagle3.* values; it keeps an embed_tokens that is a copy of the target's, which edgespec
    drops."""
    ckpt, _, _, ours_path = converted[layout]
    target_dir = hf_target_dir(tmp_path / "target", n_layer=8, n_embd=H_T, n_vocab=N_VOCAB)
    theirs, ours = read_gguf(llama_cpp_convert(ckpt, target_dir, tmp_path / "llama_cpp.gguf")), read_gguf(ours_path)
    assert set(theirs.tensors) == set(ours.tensors) | ({"token_embd.weight"} if LAYOUTS[layout][2] == "copy" else set())
    for name in ours.tensors:
        np.testing.assert_array_equal(ours.tensor(name), theirs.tensor(name), err_msg=name)
    shared = sorted(k for k in ours.kv if k.startswith("eagle3.") and k in theirs.kv)
    assert {"eagle3.target_layers", "eagle3.target_hidden_size", "eagle3.norm_before_fc"} <= set(shared)
    for key in shared:
        assert ours.value(key) == pytest.approx(theirs.value(key)), key
