"""A tiny random-weight Gemma-4 target and its Gemma-4 assistant drafter, in the HF layout, converted to
F32 GGUF by llama.cpp's vendored convert_hf_to_gguf.py (``Gemma4ForCausalLM`` -> arch ``gemma4``,
``Gemma4AssistantForCausalLM`` -> arch ``gemma4-assistant``).

Tensor names and shapes are those of transformers 5.24's ``Gemma4ForCausalLM`` /
``Gemma4AssistantForCausalLM`` built from the configs below (the models are instantiated once, on
the meta device, to list them). The tokenizer is a 512-token byte-fallback BPE (what the converter's
``LlamaHfVocab`` reads for Gemma 4), trained here with the ``tokenizers`` library.

The assistant reads the target's KV cache of its last sliding-window and last full-attention layers
(llama.cpp src/llama-model.cpp: ``share``), so its attention shapes are the target's: head size 32 on
sliding-window layers and 64 on full-attention ones (``global_head_dim``), one KV head.

Weights (``write_pair``): the blocks add their sandwich-normed outputs at ``target_scale`` (0.1) /
``assistant_scale`` (0.05), and ``_craft`` gives the assistant the target's LM head (first half), so it
predicts roughly what the target does: greedy acceptance 0.59 at γ 3 over 128 tokens (0.47 with
the assistant at 0.1 and noise 0.1; 0.0 with random assistant weights).

``gemma4_pair_agreeing`` (a session fixture; ``AGREEING``): built so that ``-k auto`` drafts. The target's
blocks at 0.02 (it scores the next token almost from the current one, which the assistant reads
exactly: noise 0), its FFNs 4096 wide (a target step of ~1-5 ms, bandwidth-bound here, beside an
assistant step of ~0.06 ms): greedy acceptance about 0.85 at γ 3.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from mtp_fixtures import CORPUS, _babble, convert_hf

AGREEING = dict(target_scale=0.02, noise=0.0, target_ffn=4096)  # gemma4_pair_agreeing

N_VOCAB = 512
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
BYTES = [f"<0x{i:02X}>" for i in range(256)]

TEXT = dict(vocab_size=N_VOCAB, num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=64,
            hidden_size_per_layer_input=0, sliding_window=64, pad_token_id=0, eos_token_id=1, bos_token_id=2,
            rms_norm_eps=1e-6, max_position_embeddings=4096)
TARGET = dict(TEXT, hidden_size=64, intermediate_size=128, num_hidden_layers=4, vocab_size_per_layer_input=N_VOCAB,
              layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"])
ASSISTANT = dict(TEXT, hidden_size=32, intermediate_size=64, num_hidden_layers=2, vocab_size_per_layer_input=0,
                 layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=2)


def write_tokenizer(d: Path) -> None:
    """A byte-fallback BPE (ids 0-3 the specials, 4-259 the bytes), Gemma's ▁ spaces."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=N_VOCAB, show_progress=False, special_tokens=SPECIALS + BYTES)
    tok.train_from_iterator(CORPUS * 4 + _babble(), trainer)
    assert tok.get_vocab_size() == N_VOCAB, tok.get_vocab_size()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>", add_bos_token=True, model_max_length=4096), indent=1))


def _shapes(kind: str, target_ffn: int = TARGET["intermediate_size"]) -> tuple[dict, dict[str, tuple[int, ...]]]:
    """(config.json, HF tensor name -> shape) of the target ("target": FFNs of `target_ffn`) or the assistant."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    from transformers.models.gemma4_assistant import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    with torch.device("meta"):
        if kind == "target":
            cfg = Gemma4TextConfig(**TARGET | dict(intermediate_size=target_ffn),
                                   tie_word_embeddings=False)  # an LM head of its own: see _craft
            model = Gemma4ForCausalLM(cfg)
            arch = "Gemma4ForCausalLM"
        else:
            cfg = Gemma4AssistantConfig(text_config=Gemma4TextConfig(**ASSISTANT).to_dict(),
                                        backbone_hidden_size=TARGET["hidden_size"])
            model = Gemma4AssistantForCausalLM(cfg)
            arch = "Gemma4AssistantForCausalLM"
    config = cfg.to_dict() | {"architectures": [arch], "torch_dtype": "float32"}
    text = config if kind == "target" else config["text_config"]
    text["global_head_dim"] = TEXT["global_head_dim"]  # as Gemma-4 configs carry it (to_dict drops it)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if kind != "target":
        shapes.pop("lm_head.weight", None)  # the assistant's LM head is its token embedding
    return config, shapes


def _weights(shapes: dict[str, tuple[int, ...]], seed: int, scale: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes.items():
        if name.endswith("layer_scalar"):
            w = np.ones(shape)
        elif name.endswith("lm_head.weight"):  # logits of std ~4: a peaked next-token distribution
            w = rng.standard_normal(shape) * 0.7
        elif name.endswith("embed_tokens.weight"):
            w = rng.standard_normal(shape) * shape[1] ** -0.5
        elif len(shape) == 1:  # Gemma's sandwich norms: a block adds post-norm(output) × these weights
            post = name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight"))
            w = (scale if post else 1.0) * (1.0 + 0.1 * rng.standard_normal(shape))
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[1])
        out[name] = w.astype(np.float32)
    return out


def _craft(t: dict[str, np.ndarray], a: dict[str, np.ndarray], noise: float, seed: int) -> None:
    """Make the assistant predict roughly what the target does: the target's token embeddings and LM
    head live in their first half (the other half zero; untied, since a tied head would make a
    mostly-bigram model repeat its current token), the assistant's LM head (its token embedding) is
    that half of the target's, its pre-projection reads the (scaled) target embedding's first half plus
    ``noise``, and its final norm is the target's first half. With the blocks at small scale, both then
    score the next token mostly from the current one."""
    rng = np.random.default_rng(seed)
    e, h = t["model.embed_tokens.weight"].shape[1], a["model.embed_tokens.weight"].shape[1]
    t["model.embed_tokens.weight"][:, h:] = 0.0
    t["lm_head.weight"][:, h:] = 0.0
    a["model.embed_tokens.weight"] = t["lm_head.weight"][:, :h].copy()
    pre = rng.standard_normal((h, 2 * e)) * noise / np.sqrt(2 * e)
    pre[:, :h] += np.eye(h)
    a["pre_projection.weight"] = pre.astype(np.float32)
    a["model.norm.weight"] = t["model.norm.weight"][:h].copy()


def write_pair(root: Path, seed: int = 0, target_scale: float = 0.1, assistant_scale: float = 0.05,
               noise: float = 0.05, target_ffn: int = TARGET["intermediate_size"]) -> tuple[Path, Path]:
    """The target's and the assistant's HF directories under ``root`` (blocks at these init scales, the
    target's FFNs `target_ffn` wide)."""
    from safetensors.numpy import save_file

    (tc, ts), (ac, ash) = _shapes("target", target_ffn), _shapes("assistant")
    tw, aw = _weights(ts, seed, target_scale), _weights(ash, seed + 1, assistant_scale)
    _craft(tw, aw, noise, seed + 2)
    dirs = []
    for kind, config, weights in (("target", tc, tw), ("assistant", ac, aw)):
        d = root / f"gemma4-{kind}-hf"
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(config, indent=1, default=str))
        save_file(weights, str(d / "model.safetensors"))
        write_tokenizer(d)
        dirs.append(d)
    return dirs[0], dirs[1]


def build_gemma4_pair(root: Path, **weights: float) -> tuple[Path, Path]:
    """(target GGUF, assistant GGUF), both F32, converted by llama.cpp's converter (``weights``:
    write_pair's keywords)."""
    root = Path(root)
    target, assistant = write_pair(root, **weights)
    return convert_hf(target, root / "gemma4-f32.gguf"), convert_hf(assistant, root / "gemma4-assistant-f32.gguf")


@pytest.fixture(scope="session")
def gemma4_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target GGUF, assistant GGUF) of the tiny Gemma-4 pair, built once a session."""
    return build_gemma4_pair(tmp_path_factory.mktemp("gemma4"))


@pytest.fixture(scope="session")
def gemma4_pair_agreeing(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target GGUF, assistant GGUF) of the pair whose assistant agrees with its target and costs little
    beside it (``AGREEING``): the one ``-k auto`` drafts on."""
    return build_gemma4_pair(tmp_path_factory.mktemp("gemma4_agreeing"), **AGREEING)
