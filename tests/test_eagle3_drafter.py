"""EAGLE-3 drafting beyond the shared head-drafter contract (tests/test_head_drafters.py): a random head
for SmolLM2 (almost never right: output must still be exact), a least-squares head for a tiny 8-layer
target (right often enough that acceptance is measured, on each runtime), and `bench` / `profile`
with a head."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from head_cases import BACKENDS, HELD_OUT, N_VOCAB, RUNTIMES, greedy_lossless
from mlx_fixtures import own_mlx_home  # noqa: F401 (MLX targets convert their GGUFs into a module's own home)
from test_lossless_reference import fixed_costs  # noqa: F401
from typer.testing import CliRunner

import edgespec
from edgespec.drafters.eagle import EagleDrafter
from edgespec.heads.eagle3 import Eagle3Config, random_tensors
from edgespec.heads.gguf_io import write_eagle3_gguf


@pytest.fixture(scope="module")
def smollm2_head(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    """A random F16 head for SmolLM2 (H 576, layers 2/15/27, V_d 8192)."""
    cfg = Eagle3Config(n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, n_embd_tgt=576, target_layers=(2, 15, 27),
                       n_vocab=N_VOCAB, n_draft_vocab=8192)
    d2t = np.sort(np.random.default_rng(0).choice(N_VOCAB, 8192, replace=False))
    return write_eagle3_gguf(tmp_path_factory.mktemp("e3d") / "smol-head.gguf", cfg,
                             random_tensors(cfg, seed=5, d2t=d2t), vocab_source=smollm2_path)


@pytest.mark.real
@pytest.mark.parametrize("gamma", [3, "auto"])
def test_greedy_spec_equals_plain_with_a_random_head_on_smollm2(smollm2_path, smollm2_head, gamma):
    from edgespec.heads.eagle3_llama import LlamaEagle3Head

    with edgespec.load(smollm2_path, drafter=smollm2_head, n_ctx=512, threads=1, num_draft=gamma) as engine:
        assert isinstance(engine.drafter, EagleDrafter) and isinstance(engine.drafter.head, LlamaEagle3Head)
        stats = greedy_lossless(engine, ["The capital of France is", "def fibonacci(n):",
                                         "Once upon a time, in a small village,"], 40)
        assert sum(s.n_drafted for s in stats) > 0 or gamma == "auto"


@pytest.mark.real
@pytest.mark.usefixtures("own_mlx_home")
@pytest.mark.parametrize("gamma", [3, "auto"])
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_fitted_head_is_accepted_and_output_stays_exact(tiny_head, runtime, gamma, request, monkeypatch):
    """Held-out prompts. With "auto", costs are fixed as on the reference backend (T(k) = 1 + 0.1(k−1)
    ms, 0.05 ms per draft token): the tiny target's real T(1) (~0.4 ms) is about one chain step of
    this head, where auto measured would take plain steps only."""
    if gamma == "auto":
        request.getfixturevalue("fixed_costs")
        monkeypatch.setattr(EagleDrafter, "measure_ms_per_token", lambda self, repeats=8: 0.05)
    target, head = tiny_head("eagle3")
    with edgespec.load(target, drafter=head, backend=BACKENDS[runtime], n_ctx=512, threads=1,
                       num_draft=gamma) as engine:
        cycles = [c for s in greedy_lossless(engine, HELD_OUT, 64) for c in s.cycles if c[0] > 0]
    drafted, accepted = sum(d for d, _ in cycles), sum(n for _, n in cycles)
    first = sum(n > 0 for _, n in cycles) / max(1, len(cycles))
    print(f"{runtime} γ={gamma}: {len(cycles)} drafting cycles, accepted {accepted} of {drafted} drafts, "
          f"first position {first:.2f}")
    assert accepted >= 0.25 * drafted > 0 and first >= 0.4  # measured γ=3: 0.42 of drafts, 0.59 at position 1


@pytest.mark.real
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_bench_with_a_head_runs_plain_on_a_plain_backend(tiny_head, runtime, tmp_path, monkeypatch):
    """`edgespec bench --drafter head.gguf`: speculative runs on the feature-capturing target, plain runs on
    a plain backend of the same file; greedy outputs agree across the two."""
    import json

    import edgespec.bench.run as bench_run
    from edgespec.cli.app import app

    if runtime == "mlx":
        from edgespec.backends.mlx_features import MlxFeatureBackend as Capturing
    else:
        from edgespec.backends.llama_features import LlamaFeatureBackend as Capturing
    real, seen = bench_run.run_matrix, {}

    def spy(engine, drafters, configs, tasks, temps, repeats, chat, on_run, plain_engine=None):
        seen["spec"], seen["plain"] = type(engine.target), type(plain_engine.target)
        return real(engine, drafters, configs, tasks, temps, repeats, chat, on_run, plain_engine)

    monkeypatch.setattr(bench_run, "run_matrix", spy)
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    target, head = tiny_head("eagle3")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["bench", "--backend", BACKENDS[runtime], "--target", str(target), "--drafter",
                                      str(head), "-k", "3", "--max-tokens", "24", "--per-category", "1",
                                      "--category", "code_edit", "--category", "story", "--threads", "1", "--ctx",
                                      "512", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert seen["spec"] is Capturing and not issubclass(seen["plain"], Capturing)
    runs = json.loads((out / "results.json").read_text())["runs"]
    spec = [r for r in runs if r["config"] != "plain"]
    assert len(spec) == 2 and all(r["matches_plain"] for r in spec)
    assert sum(sum(c[0] for c in r["cycles"]) for r in spec) > 0  # it drafted


@pytest.mark.real
def test_profile_costs_a_head(tiny_head, tmp_path, monkeypatch):
    from edgespec.cli.app import app

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    target, head = tiny_head("eagle3")
    result = CliRunner().invoke(app, ["profile", "--model", str(target), "--drafter", str(head), "--max-k", "4",
                                      "--repeats", "2", "--threads", "1"])
    assert result.exit_code == 0, result.output
    assert "ms per drafted token" in result.output and "E[τ(γ)]" in result.output
