"""`edgespec train-head`: one-line errors (torch missing, bad --kind) and a tiny end-to-end run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cli_subprocess import run_cli_without
from gguf_fixtures import build_tiny_llama
from typer.testing import CliRunner

from edgespec.cli import app as cli

runner = CliRunner()

def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def test_missing_torch_names_the_train_extra(tmp_path: Path) -> None:
    proc = run_cli_without("torch", "train-head", "--target", "x.gguf", "--out", str(tmp_path / "h.gguf"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    [line] = _lines(proc.stderr)
    assert line.startswith("error: ") and "edgespec[train]" in line


@pytest.mark.parametrize("args, words", [(["--kind", "hydra"], ["--kind", "eagle3", "medusa", "hydra"]),
                                         (["--weight-type", "q4_0"], ["--weight-type", "q4_0"]),
                                         (["--kind", "dspark"], ["--base"]),
                                         (["--kind", "dflash", "--block-size", "1"], ["--block-size", "1"]),
                                         (["--decay-shape", "cosine"], ["--decay-shape", "--lr-decay"]),
                                         (["--warmup-steps", "-1"], ["--warmup-steps", "-1"]),
                                         (["--budget-min", "0"], ["--budget-min", "--max-steps"]),
                                         (["--device", "tpu"], ["--device", "tpu"])])
def test_bad_options_are_one_line_errors(tmp_path: Path, args: list[str], words: list[str]) -> None:
    result = runner.invoke(cli.app, ["train-head", "--target", "x.gguf", "--out", str(tmp_path / "h.gguf"), *args])
    assert result.exit_code == 1
    [line] = _lines(result.output)
    assert line.startswith("error: ") and all(w in line for w in words)


def test_an_absent_device_is_a_one_line_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this CPU-only machine
    result = runner.invoke(cli.app, ["train-head", "--target", "x.gguf", "--out", str(tmp_path / "h.gguf"),
                                     "--device", "cuda"])
    assert result.exit_code == 1
    [line] = _lines(result.output)
    assert line.startswith("error: --device cuda") and "CUDA" in line


def test_too_shallow_target_is_a_one_line_error(tmp_path: Path, tiny_target: Path) -> None:
    result = runner.invoke(cli.app, ["train-head", "--target", str(tiny_target), "--out", str(tmp_path / "h.gguf"),
                                     "--work-dir", str(tmp_path / "w"), "--max-steps", "1"])
    assert result.exit_code == 1
    assert _lines(result.output)[-1].startswith("error: ") and "at least 5 layers" in result.output


def test_train_head_end_to_end(tmp_path: Path, smollm2_path: Path) -> None:
    """A 5-layer tiny target on --device cpu: features, d2t, 3 steps of a warm-up + cosine schedule, a Q8_0
    GGUF with provenance and a curve row per step; --resume continues the curve."""
    pytest.importorskip("torch")
    import importlib.util

    from edgespec.gguf_file import read_gguf
    from edgespec.heads.gguf_io import read_eagle3_gguf
    from edgespec.train.curve import read_curve

    target = build_tiny_llama(tmp_path / "t5.gguf", vocab_source=smollm2_path, seed=0, n_layer=5)
    out = tmp_path / "head.gguf"
    args = ["train-head", "--target", str(target), "--out", str(out), "--kind", "eagle3", "--max-steps", "3",
            "--seed", "1", "--draft-vocab", "300", "--weight-type", "q8_0", "--corpus-chars", "6000",
            "--prompts", "1", "--gen-tokens", "8", "--threads", "1", "--work-dir", str(tmp_path / "w"),
            "--device", "cpu", "--eval-every", "1", "--warmup-steps", "1", "--lr-decay", "--decay-shape", "cosine",
            "--gen-prompts", "6", "--n-seq", "4", "--heldout-gen", "2"]
    result = runner.invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    curve = tmp_path / "w" / "curve-eagle3-v300-s1.csv"
    rows = read_curve(curve)
    assert [r["step"] for r in rows] == ["1", "2", "3"] and "tokens on cpu" in result.output
    assert all(float(r["tau"]) == 1 + sum(float(r[f"acc_{k}"]) for k in (1, 2, 3, 4)) for r in rows)
    if importlib.util.find_spec("matplotlib"):
        assert curve.with_suffix(".png").exists()
    else:
        assert "no PNG" in result.output and not curve.with_suffix(".png").exists()
    cfg, tensors = read_eagle3_gguf(out)
    assert cfg.target_layers == (2, 2, 2) and cfg.n_draft_vocab == 300 and cfg.n_embd_tgt == 64
    assert len(np.unique(tensors["d2t"])) == 300
    meta = read_gguf(out, lambda k: k.startswith("edgespec."), with_tensors=False)
    assert meta.value("edgespec.head.trained_steps") == "3" and meta.value("edgespec.head.seed") == "1"
    # the batched self-distilled replies: in the cache's manifest, the resumable replies file, the provenance
    from edgespec.train.features import FeatureCache

    gen = [e for e in FeatureCache(tmp_path / "w" / "train").manifest() if e["source"].startswith("gen:")]
    assert len(gen) == 6 and len((tmp_path / "w" / "generated.jsonl").read_text().splitlines()) == 8
    # --heldout-gen: the first 2 generated replies are evaluated (a cache of their own), never trained on
    held_gen = FeatureCache(tmp_path / "w" / "heldout-gen").manifest()
    assert len(held_gen) == 2 and all(e["source"].startswith("gen:") for e in held_gen)
    train_seqs = {tuple(FeatureCache.load_file(f)["tokens"]) for f in FeatureCache(tmp_path / "w" / "train").files()}
    assert not train_seqs & {tuple(FeatureCache.load_file(f)["tokens"])
                             for f in FeatureCache(tmp_path / "w" / "heldout-gen").files()}
    assert "  heldout: " in result.output and "  heldout-gen: " in result.output
    assert "gen:" in meta.value("edgespec.head.data") and "greedy)" in meta.value("edgespec.head.data")
    result = runner.invoke(cli.app, [*args[:8], "5", *args[9:], "--resume"])
    assert result.exit_code == 0, result.output
    assert "resumed from" in result.output and "at step 3" in result.output
    assert "decay_steps 3 → 5" in result.output  # --max-steps moved the end of the decay
    assert [r["step"] for r in read_curve(curve)] == ["1", "2", "3", "4", "5"]
    assert read_curve(curve)[:3] == rows
    meta = read_gguf(out, lambda k: k.startswith("edgespec."), with_tensors=False)
    assert meta.value("edgespec.head.trained_steps") == "5"
    # more --gen-prompts on the same work dir: only the 2 new replies are generated and evaluated
    caches = [tmp_path / "w" / d for d in ("train", "heldout-gen")]
    before = {f: f.stat().st_mtime_ns for c in caches for f in FeatureCache(c).files()}
    n_train = len(FeatureCache(caches[0]).files())
    i = args.index("--gen-prompts")
    result = runner.invoke(cli.app, [*args[:8], "6", *args[9:i + 1], "8", *args[i + 2:], "--resume"])
    assert result.exit_code == 0, result.output
    assert f"training data: {n_train} → {n_train + 2} sequences since the checkpoint" in result.output
    assert len((tmp_path / "w" / "generated.jsonl").read_text().splitlines()) == 10
    assert {f: f.stat().st_mtime_ns for f in before} == before
    assert len(FeatureCache(caches[0]).files()) == n_train + 2 and len(FeatureCache(caches[1]).files()) == 2


def test_train_head_dflash_then_dspark(tmp_path: Path, smollm2_path: Path) -> None:
    """--kind dflash on the 5-layer tiny target: EAGLE-3's feature layers, the target's shape, B = 8,
    the unknown token as MASK, provenance; the drafters recognise the file as a DFlash head. Then
    --kind dspark on it (same work dir: the feature cache is reused) adds only the Markov and
    confidence tensors."""
    pytest.importorskip("torch")
    from edgespec.drafters.heads import head_arch
    from edgespec.gguf_file import read_gguf
    from edgespec.heads.dflash_gguf import read_dflash_gguf

    target = build_tiny_llama(tmp_path / "t5.gguf", vocab_source=smollm2_path, seed=0, n_layer=5)
    out = tmp_path / "dflash.gguf"
    common = ["--target", str(target), "--max-steps", "3", "--draft-vocab", "300", "--corpus-chars", "6000",
              "--prompts", "1", "--gen-tokens", "8", "--threads", "1", "--work-dir", str(tmp_path / "w")]
    result = runner.invoke(cli.app, ["train-head", *common, "--out", str(out), "--kind", "dflash"])
    assert result.exit_code == 0, result.output
    assert head_arch(out) == "dflash"
    cfg, tensors = read_dflash_gguf(out)
    assert cfg.target_layers == (2, 2, 2) and cfg.n_embd == 64 and cfg.n_layer == 1 and cfg.block_size == 8
    assert cfg.n_draft_vocab == 300 and cfg.mask_token_id == 0 and not cfg.causal
    meta = read_gguf(out, lambda k: k.startswith("edgespec."), with_tensors=False)
    assert meta.value("edgespec.head.trained_steps") == "3"
    assert len(meta.value("edgespec.head.heldout_acceptance").split(",")) == 7
    spark = tmp_path / "dspark.gguf"
    result = runner.invoke(cli.app, ["train-head", *common, "--out", str(spark), "--kind", "dspark", "--base", str(out),
                                     "--markov-rank", "8"])
    assert result.exit_code == 0, result.output
    scfg, stensors = read_dflash_gguf(spark)
    assert scfg.markov_rank == 8 and scfg.has_confidence and not scfg.sample_from_anchor
    assert set(stensors) - set(tensors) == {"markov_w1.weight", "markov_w2.weight", "conf_proj.weight",
                                            "conf_proj.bias"}
    assert all(np.array_equal(stensors[k], tensors[k]) for k in tensors)  # the base, frozen
