"""EAGLE-3 heads on the MLX backend end to end: `edgespec.load(..., backend="mlx", drafter=head.gguf)`
opens an MlxFeatureBackend and an MlxEagle3Head; greedy speculative output equals plain greedy output,
the MLX head drafts what the numpy head drafts, a head for another target is refused, and the CLI's
generate and bench take a head with --backend mlx. Tiny 8-layer F32 target with a least-squares head."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from eagle_fixtures import fit_tiny_head
from gguf_fixtures import build_tiny_llama
from head_oracles import oracle_drafter
from mlx_fixtures import own_mlx_home  # noqa: F401 (used by pytestmark)
from test_eagle3_drafter import FIT_PROMPTS, HELD_OUT
from typer.testing import CliRunner

pytest.importorskip("mlx.core", reason="mlx is not installed: pip install 'edgespec[mlx]'")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed: pip install 'edgespec[mlx]'")

import edgespec  # noqa: E402
from edgespec.backends.mlx_features import MlxFeatureBackend  # noqa: E402
from edgespec.drafters.eagle import EagleDrafter  # noqa: E402
from edgespec.drafters.registry import open_drafter, open_target  # noqa: E402
from edgespec.errors import EdgespecError  # noqa: E402
from edgespec.heads.eagle3_mlx import MlxEagle3Head  # noqa: E402
from edgespec.sampling import SamplingParams  # noqa: E402

pytestmark = [pytest.mark.real, pytest.mark.usefixtures("own_mlx_home")]  # the fixtures copy SmolLM2's tokenizer


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> tuple[Path, Path]:
    """An 8-layer tiny target whose layers add little (layer_scale 0.1) and a least-squares head."""
    d = tmp_path_factory.mktemp("mlxe3")
    target = build_tiny_llama(d / "tiny8.gguf", vocab_source=smollm2_path, n_layer=8, seed=0, layer_scale=0.1)
    return target, fit_tiny_head(target, d / "tiny8-head.gguf", smollm2_path, FIT_PROMPTS)


@pytest.mark.parametrize("gamma", [3, "auto"])
def test_greedy_spec_equals_plain_with_a_head_on_mlx(tiny_pair, gamma):
    target, head = tiny_pair
    with edgespec.load(target, drafter=head, backend="mlx", n_ctx=512, threads=1, num_draft=gamma) as engine:
        assert isinstance(engine.target, MlxFeatureBackend) and engine.target.feature_layers == (2, 4, 5)
        assert isinstance(engine.drafter, EagleDrafter) and isinstance(engine.drafter.head, MlxEagle3Head)
        drafted = accepted = 0
        for prompt in HELD_OUT:
            plain = engine.generate(prompt, max_tokens=48, speculative=False)
            spec = engine.generate(prompt, max_tokens=48)
            assert spec.tokens == plain.tokens, prompt
            drafted, accepted = drafted + spec.stats.n_drafted, accepted + spec.stats.n_accepted
    print(f"γ={gamma}: accepted {accepted} of {drafted} drafts")
    if gamma == 3:
        assert accepted >= 0.25 * drafted > 0  # the fitted head is right often on MLX features too


def test_mlx_head_drafts_what_the_numpy_head_drafts(tiny_pair):
    """Both heads on one MLX target (the MLX head borrowing the target's MLX token_embd, the numpy
    head its GGUF's): the same first-position logits and the same greedy chain."""
    target_path, head = tiny_pair
    with open_target(target_path, head, "mlx", n_ctx=256, threads=1) as target:
        mlx_d, np_d = open_drafter(head, target), oracle_drafter(head, target)
        assert isinstance(mlx_d.head, MlxEagle3Head) and not isinstance(np_d.head, MlxEagle3Head)
        ctx = target.tokenize("The quick brown fox jumps over")
        target.eval(ctx[:-1], rows="none")
        (a, _), (b, _) = mlx_d.sync(ctx), np_d.sync(ctx)
        rng = np.random.default_rng(0)
        da, db = mlx_d.draft(ctx, 4, SamplingParams(), rng), np_d.draft(ctx, 4, SamplingParams(), rng)
        ms = mlx_d.measure_ms_per_token()
    fin = np.isfinite(b)
    diff = np.abs(a[fin] - b[fin]).max() / (b[fin].max() - b[fin].min())
    print(f"MLX vs numpy head on MLX features: {diff:.1e} of the logit range; chain step {ms:.2f} ms")
    assert np.array_equal(np.isfinite(a), fin) and diff <= 1e-4
    assert da.tokens == db.tokens and len(da.tokens) == 4


def test_a_head_for_another_target_is_refused_on_mlx(tiny_pair, tiny_target):
    _, head = tiny_pair
    with pytest.raises(EdgespecError, match=r"reads target layers \(2, 4, 5\), but target .* has 2 layers"):
        edgespec.load(tiny_target, drafter=head, backend="mlx")
    with pytest.raises(EdgespecError, match="unknown backend 'tpu'"):
        edgespec.load(tiny_target, drafter=head, backend="tpu")


def test_cli_generate_and_bench_with_a_head_on_mlx(tiny_pair, tmp_path):
    from edgespec.cli.app import app

    target, head = tiny_pair
    result = CliRunner().invoke(app, ["generate", "--backend", "mlx", "--target", str(target), "--drafter", str(head),
                                      "-k", "3", "-n", "16", "--threads", "1", "--ctx", "256", "-p", "Hello, world!"])
    assert result.exit_code == 0, result.output
    assert "τ" in result.stderr
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["bench", "--backend", "mlx", "--target", str(target), "--drafter", str(head),
                                      "-k", "3", "--max-tokens", "16", "--per-category", "1", "--category", "story",
                                      "--threads", "1", "--ctx", "512", "--out", str(out)])
    assert result.exit_code == 0, result.output
    runs = json.loads((out / "results.json").read_text())["runs"]
    spec = [r for r in runs if r["config"] != "plain"]
    assert len(spec) == 1 and all(r["matches_plain"] for r in spec)
