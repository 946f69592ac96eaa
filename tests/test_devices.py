"""The device zoo (edgespec/bench/devices): bundled profiles load, interpolation, steps, errors,
and a profile written the way `edgespec profile` writes one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgespec.bench import devices
from edgespec.bench.devices import K_MAX, bundled, from_profile, load_device


def test_bundled_profiles_load_positive_and_sourced():
    names = bundled()
    assert {"cpu-epyc-q4", "cpu-epyc-f32"} <= set(names)
    assert len([n for n in names if not n.startswith("cpu-")]) >= 6
    for name in names:
        dev = load_device(name)
        assert len(dev.t_ms) == K_MAX + 1 and dev.t_ms[0] == 0.0
        assert all(t > 0 for t in dev.t_ms[1:]), name
        assert dev.sources, name
        assert dev.description, name
        assert dev.draft.get("ngram") == (0.0, 0.0), name
        raw = json.loads((_dir() / f"{name}.json").read_text())
        assert raw.get("notes"), name
        assert set(raw["t_ms"]) == {str(k) for k in range(1, K_MAX + 1) if k not in dev.interpolated}


def _dir() -> Path:
    return Path(devices.__file__).parent


def _write(tmp_path, t_ms, **extra):
    path = tmp_path / "dev.json"
    path.write_text(json.dumps({"name": "x", "description": "d", "t_ms": t_ms, "draft": {"model": [0.1, 0.2]},
                                "sources": ["s"], **extra}))
    return path


def test_interpolation_is_linear_and_extrapolation_follows_the_last_two(tmp_path):
    dev = load_device(_write(tmp_path, {"1": 10.0, "4": 16.0, "8": 20.0, "9": 40.0, "16": 54.0}))
    assert dev.t(2) == pytest.approx(12.0) and dev.t(3) == pytest.approx(14.0)
    assert dev.t(6) == pytest.approx(18.0)
    assert [dev.t(k) for k in range(9, 17)] == pytest.approx([40.0 + 2.0 * i for i in range(8)])
    assert dev.t(32) == pytest.approx(54.0 + 2.0 * 16)
    assert dev.interpolated == tuple(k for k in range(1, K_MAX + 1) if k not in (1, 4, 8, 9, 16))


def test_a_step_at_8_9_survives(tmp_path):
    dev = load_device(_write(tmp_path, {"1": 10.0, "8": 14.0, "9": 31.0, "32": 40.0}))
    assert dev.t(9) - dev.t(8) == pytest.approx(17.0)
    cuda = load_device("cuda-34b-q8_0")
    raw = json.loads((_dir() / "cuda-34b-q8_0.json").read_text())["t_ms"]
    assert cuda.t(9) - cuda.t(8) == pytest.approx(raw["9"] - raw["8"])
    assert cuda.t(9) > 2 * cuda.t(8)


def test_draft_ms(tmp_path):
    dev = load_device(_write(tmp_path, {"1": 10.0}))
    assert dev.draft_ms("model", 0) == 0.0
    assert dev.draft_ms("model", 3) == pytest.approx((0.1 + 3 * 0.2) * 10.0)
    with pytest.raises(KeyError, match="head"):
        dev.draft_ms("head", 2)


@pytest.mark.parametrize("content, problem", [
    ("{not json", "not valid JSON"),
    (json.dumps({"t_ms": {"2": 5.0}}), "T(1)"),
    (json.dumps({"t_ms": {"1": 5.0, "2": -1.0}}), "T(k) > 0"),
    (json.dumps({"t_ms": {"1": 5.0, "40": 9.0}}), "1 ≤ k"),
    (json.dumps({"t_ms": {"1": 5.0}, "draft": {"model": "fast"}}), "draft"),
])
def test_bad_file_is_a_one_line_value_error_naming_it(tmp_path, content, problem):
    path = tmp_path / "broken.json"
    path.write_text(content)
    with pytest.raises(ValueError) as e:
        load_device(path)
    msg = str(e.value)
    assert "broken.json" in msg and problem in msg and "\n" not in msg


def test_unknown_name(tmp_path):
    with pytest.raises(ValueError, match="no-such-device"):
        load_device("no-such-device")


def test_from_profile_reads_calibrations_json(tmp_path):
    from edgespec.calibration import CostProfile

    prof = CostProfile(model="/m/SmolLM2-135M-Instruct.F32.gguf", sha256="ab" * 32, backend="llama.cpp",
                       version="0.3.36", threads=2, t_forward_ms={1: 14.5, 2: 18.0, 4: 22.0, 8: 28.1, 16: 43.5},
                       draft_kind="draft_model", draft_fixed_ms=1.45, draft_per_token_ms=8.7, context_ms=0.005)
    path = tmp_path / "6532799f494167f7-llama.cpp-t2-v0.3.36.json"
    path.write_text(prof.to_json())  # what calibration.save_profile writes
    dev = from_profile(path)
    assert dev.t(1) == 14.5 and dev.t(8) == 28.1
    assert dev.t(3) == pytest.approx(20.0) and 3 in dev.interpolated
    assert dev.ctx_us == pytest.approx(5.0)
    assert dev.draft["draft_model"] == pytest.approx((0.1, 0.6))
    assert dev.draft_ms("draft_model", 2) == pytest.approx(1.45 + 2 * 8.7)
    assert dev.sources == (str(path),)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="bad.json"):
        from_profile(tmp_path / "bad.json")
