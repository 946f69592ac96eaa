"""`edgespec train-head --dtype auto|float32|bfloat16` (issue 50): auto autocasts to bfloat16 only where
bf16 is fast (a CUDA GPU with bf16, a CPU reporting avx512_bf16 or AMX), float32 elsewhere (an AVX2-only
CPU emulates bf16, several times slower); a bad value is a one-line error; the choice reaches the shared
training loop (TrainConfig.bf16) and the head's GGUF metadata."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

torch = pytest.importorskip("torch")

from edgespec.cli import app as cli  # noqa: E402
from edgespec.gguf_file import read_gguf  # noqa: E402
from edgespec.train import trainer as T  # noqa: E402

runner = CliRunner()
EPYC_AVX2 = frozenset("fpu sse2 avx avx2 fma bmi2 sha_ni".split())
ZEN4 = EPYC_AVX2 | {"avx512f", "avx512bw", "avx512_bf16"}
SAPPHIRE = EPYC_AVX2 | {"avx512f", "amx_tile", "amx_bf16", "amx_int8"}


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    x86, arm = tmp_path / "x86", tmp_path / "arm"
    x86.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n")
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert T.cpu_flags(x86) == {"fpu", "avx2", "avx512_bf16"}
    assert T.cpu_flags(arm) == {"fp", "asimd", "bf16"}
    assert T.cpu_flags(tmp_path / "absent") == frozenset()


@pytest.mark.parametrize("flags, fast", [(EPYC_AVX2, False), (ZEN4, True), (SAPPHIRE, True), (frozenset(), False)])
def test_auto_is_bf16_only_on_a_cpu_with_bf16_instructions(flags: frozenset[str], fast: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert T.fast_bf16(cpu, flags) is fast
    monkeypatch.setattr(T, "cpu_flags", lambda: flags)
    assert T.resolve_dtype("auto", cpu) is fast
    assert T.resolve_dtype("float32", cpu) is False and T.resolve_dtype("bfloat16", cpu) is True


@pytest.mark.parametrize("supported", [True, False])
def test_auto_on_cuda_follows_its_bf16_support(supported: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: supported)
    assert T.resolve_dtype("auto", torch.device("cuda")) is supported
    assert T.resolve_dtype("auto", torch.device("mps")) is False  # mps trains in float32 (autocast_dtype)
    with pytest.raises(ValueError, match="--dtype must be one of auto, float32, bfloat16 .*'fp16'"):
        T.resolve_dtype("fp16", torch.device("cpu"))


def test_bad_dtype_is_a_one_line_error(tmp_path: Path) -> None:
    result = runner.invoke(cli.app, ["train-head", "--target", "x.gguf", "--out", str(tmp_path / "h.gguf"),
                                     "--dtype", "fp16"])
    assert result.exit_code == 1
    [line] = [ln for ln in result.output.splitlines() if ln.strip()]
    assert line.startswith("error: --dtype") and all(w in line for w in ("auto", "float32", "bfloat16", "fp16"))


@pytest.mark.parametrize("dtype, flags, bf16", [("auto", EPYC_AVX2, False), ("auto", ZEN4, True),
                                                ("float32", ZEN4, False), ("bfloat16", EPYC_AVX2, True)])
def test_the_flag_reaches_the_training_config(dtype: str, flags: frozenset[str], bf16: bool, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Every kind shares the loop: the CLI's job carries TrainConfig.bf16 (the pipeline stubbed out)."""
    from edgespec.errors import EdgespecError
    from edgespec.train import pipeline

    jobs = []

    def stub(job, **_):
        jobs.append(job)
        raise EdgespecError("stubbed")

    monkeypatch.setattr(T, "cpu_flags", lambda: flags)
    monkeypatch.setattr(pipeline, "train_head", stub)
    (tmp_path / "t.gguf").write_bytes(b"")  # resolved by path only: the stub reads nothing
    for kind in ("eagle3", "dflash", "medusa"):
        result = runner.invoke(cli.app, ["train-head", "--target", str(tmp_path / "t.gguf"), "--out",
                                         str(tmp_path / "h.gguf"), "--kind", kind, "--device", "cpu", "--dtype", dtype])
        assert "stubbed" in result.output, result.output
    assert [j.train.bf16 for j in jobs] == [bf16] * 3


def test_a_float32_run_says_so(tmp_path: Path, tiny_target: Path) -> None:
    """One Medusa step on the 2-layer tiny target with --dtype float32: the status line and the GGUF's
    metadata name the precision."""
    out = tmp_path / "m.gguf"
    result = runner.invoke(cli.app, ["train-head", "--target", str(tiny_target), "--out", str(out), "--kind", "medusa",
                                     "--medusa-heads", "2", "--max-steps", "1", "--corpus-chars", "2000", "--prompts",
                                     "1", "--gen-tokens", "8", "--threads", "1", "--work-dir", str(tmp_path / "w"),
                                     "--device", "cpu", "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert "device cpu, float32" in result.output
    assert read_gguf(out, with_tensors=False).value("edgespec.head.train_dtype") == "float32"
