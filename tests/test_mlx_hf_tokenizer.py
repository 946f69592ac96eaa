"""An mlx-lm model directory that carries tokenizer.json (as mlx-community publishes them) instead of
tokenizer.gguf: the MLX backend tokenizes through `transformers` (hf_vocab.py). The fixture writes a
byte-level BPE tokenizer.json from SmolLM2's GGUF vocabulary and merges, so token ids can be checked
against llama.cpp's tokenizer of the same vocabulary."""

from __future__ import annotations

import gguf
import pytest

pytest.importorskip("mlx.core", reason="mlx is not installed: pip install 'edgespec[mlx]'")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed: pip install 'edgespec[mlx]'")

import edgespec  # noqa: E402
from edgespec.backends.mlx_convert import TOKENIZER_FILE, convert_gguf  # noqa: E402
from edgespec.drafters.registry import open_backend  # noqa: E402

pytestmark = pytest.mark.real  # the tokenizer comes from SmolLM2's GGUF
TEXTS = ["Hello world, this is a test.", "def add(a, b):\n    return a + b\n", "1, 2, 3, 4, 5,"]


@pytest.fixture(scope="module")
def hf_dir(tiny_target, tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("hf") / "tiny"
    convert_gguf(tiny_target, out)
    (out / TOKENIZER_FILE).unlink()
    fields = gguf.GGUFReader(tiny_target).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"].contents()]
    eos = tokens[fields["tokenizer.ggml.eos_token_id"].contents()]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos)
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.save_pretrained(out)
    return out


def test_tokenizer_json_matches_llama_cpp(hf_dir, tiny_target):
    lc, ml = open_backend(tiny_target, n_ctx=256), open_backend(hf_dir, "mlx", n_ctx=256)
    assert type(ml._vocab).__name__ == "HfVocab"
    for text in TEXTS:
        ids = lc.tokenize(text, add_special=False)
        assert ml.tokenize(text, add_special=False) == ids
        assert b"".join(ml.token_to_bytes(t) for t in ids) == text.encode()
    eos = lc.eos_id
    assert ml.eos_id == eos and ml.is_eog(eos) and ml.token_to_bytes(eos) == b""
    assert ml.vocab_fingerprint().n_vocab == lc.n_vocab


def test_generation_through_tokenizer_json(hf_dir):
    with edgespec.load(hf_dir, drafter="ngram", backend="mlx", n_ctx=256) as engine:
        text = TEXTS[1] * 2
        plain = engine.generate(text, max_tokens=24, speculative=False)
        spec = engine.generate(text, max_tokens=24, num_draft=3)
        assert spec.tokens == plain.tokens and len(plain.tokens) > 0
        assert spec.stats.n_drafted > 0 and spec.text == plain.text
