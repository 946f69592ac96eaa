"""GGUF → MLX on tiny fixture GGUFs (SmolLM2's tokenizer, random f32 weights): the converted model
matches llama.cpp's logits, greedy speculative == plain on MLX for a draft pair and n-gram, and the
CLI converts and generates with --backend mlx."""

from __future__ import annotations

import numpy as np
import pytest
from mlx_fixtures import own_mlx_home  # noqa: F401 (used by pytestmark)
from typer.testing import CliRunner

pytest.importorskip("mlx.core", reason="mlx is not installed: pip install 'edgespec[mlx]'")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed: pip install 'edgespec[mlx]'")

import edgespec  # noqa: E402
from edgespec.cli import app as cli  # noqa: E402
from edgespec.drafters.registry import open_backend  # noqa: E402

pytestmark = [pytest.mark.real, pytest.mark.usefixtures("own_mlx_home")]  # the fixtures copy SmolLM2's tokenizer
PROMPTS = ["The history of the printing press begins", "def fibonacci(n):\n", "1, 2, 3, 4, 5,",
           "Once upon a time, in a village", "Q: What is the boiling point of water?\nA:"]


def test_converted_f32_model_matches_llama_cpp(tiny_target):
    """f32 weights stay f32, so the only differences are summation order: RoPE layout, names, the
    untied head and the tokenizer are all checked by near-equality of every logit row."""
    lc = open_backend(tiny_target, n_ctx=256)
    ml = open_backend(tiny_target, "mlx", n_ctx=256)
    ids = lc.tokenize(" ".join(PROMPTS))
    assert ml.tokenize(" ".join(PROMPTS)) == ids and ml.n_vocab == lc.n_vocab
    assert ml.token_to_bytes(ids[3]) == lc.token_to_bytes(ids[3]) and ml.is_eog(lc.eos_id)
    assert ml.metadata("tokenizer.chat_template") == lc.metadata("tokenizer.chat_template")
    a, b = lc.eval(ids, "all"), ml.eval(ids, "all")  # (T, V)
    diff = np.abs(a - b).max(1)  # measured: <= 3e-4 of the logit range (llama.cpp's KV cache is Q8_0)
    assert (diff <= 1e-3 * (a.max(1) - a.min(1))).all()
    top2 = np.sort(a, axis=1)[:, -2:]
    flips = a.argmax(1) != b.argmax(1)  # allowed only at near-ties, closer than the row's difference
    assert (top2[flips, 1] - top2[flips, 0] <= 2 * diff[flips]).all() and flips.mean() <= 0.05


@pytest.mark.parametrize("drafter", ["ngram", "pair"])
def test_greedy_spec_equals_plain_on_mlx(drafter, tiny_target, tiny_drafter):
    spec_drafter = str(tiny_drafter) if drafter == "pair" else "ngram"
    with edgespec.load(tiny_target, drafter=spec_drafter, backend="mlx", n_ctx=512) as engine:
        assert engine.target.name == "mlx"
        if drafter == "pair":
            assert engine.drafter.model.name == "mlx"  # the draft model runs on the same backend
        drafted = 0
        for text in PROMPTS:
            prompt = f"{text} {text}"  # its tail occurs earlier: the n-gram drafter has matches to draft
            plain = engine.generate(prompt, max_tokens=64, speculative=False)
            for gamma in (3, "auto"):
                spec = engine.generate(prompt, max_tokens=64, num_draft=gamma)
                assert spec.tokens == plain.tokens, (prompt, gamma)
                drafted += spec.stats.n_drafted
        assert drafted > 0


def test_cli_convert_then_generate_on_mlx(tiny_target, tmp_path):
    runner = CliRunner()
    out = tmp_path / "tiny-mlx"
    res = runner.invoke(cli.app, ["convert", "--to", "mlx", str(tiny_target), str(out)])
    assert res.exit_code == 0, res.output
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.gguf"}
    assert "float32" in res.stderr
    res = runner.invoke(cli.app, ["generate", "--backend", "mlx", "--target", str(out), "-p", "Hello",
                                  "-n", "8", "-k", "3"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(cli.app, ["convert", "--to", "onnx", str(tiny_target), str(out)])
    assert res.exit_code == 1 and "--to must be one of mlx" in res.stderr
    res = runner.invoke(cli.app, ["generate", "--backend", "tpu", "-p", "x"])
    assert res.exit_code == 1 and "--backend must be one of llama.cpp, mlx" in res.stderr
