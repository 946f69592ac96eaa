"""Cost profiles: T(k) timing mechanics, the E[τ(γ)] estimator, the ideal-speedup formula, the cache."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from edgespec.backends.reference import ReferenceBackend
from edgespec.bench.profile import expected_tau
from edgespec.calibration import READ_TOKENS, CostProfile, cache_path, context_cost, read_cost, time_forward


def test_time_forward_covers_every_k_and_leaves_the_cache_empty():
    backend = ReferenceBackend(8, n_ctx=512)
    t = time_forward(backend, [1, 2, 4, 8], repeats=3)
    assert sorted(t) == [1, 2, 4, 8] and all(v > 0 for v in t.values())
    assert backend.n_past == 0
    assert backend.n_evals == 2 + 3 * 4  # context + warm-up, then every k in every repeat


class _Attending(ReferenceBackend):
    """A reference model whose forwards take `us` µs per token per cached token (plus a base)."""

    def __init__(self, us: float, step_s: float = 0.0) -> None:
        super().__init__(8, n_ctx=1024)
        self.us, self.step_s = us, step_s

    def eval(self, tokens, rows="last"):
        import time

        time.sleep(self.step_s + 0.0005 + len(tokens) * self.n_past * self.us * 1e-6)
        return super().eval(tokens, rows)


def test_a_backend_too_slow_to_time_the_context_term_is_not_asked_again(monkeypatch, tmp_path):
    """The verdict is kept with the profile: a step near SLOW_STEP_S must not time the context term
    in whichever later engine happens on a quick moment."""
    from edgespec import calibration

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    model = tmp_path / "model.bin"
    model.write_bytes(b"weights")
    backend = _Attending(us=2.0, step_s=0.03)
    backend.path = str(model)
    assert context_cost(backend, far=256, repeats=3) == 0.0
    monkeypatch.setattr(calibration, "_slow", lambda b: pytest.fail("asked again"))
    assert context_cost(backend, far=256, repeats=3) == 0.0


def test_context_cost_measures_what_each_cached_token_adds():
    backend = _Attending(us=5.0)  # T(16) after 64 tokens: 5.6 ms; after 320: 26.1 ms
    ms = context_cost(backend, far=256, repeats=3)
    assert ms == pytest.approx(0.005, rel=0.3)
    assert backend.n_past == 0
    assert context_cost(_Attending(us=0.0), far=256, repeats=3) == pytest.approx(0.0, abs=0.0003)
    # a backend too slow for a brief timing (MLX on a small CPU): no context term rather than a wait
    assert context_cost(_Attending(us=2.0, step_s=0.03), far=256, repeats=3) == 0.0
    # ... unless a measurement was asked for (`edgespec profile`: refresh), however slow a step is
    assert context_cost(_Attending(us=5.0, step_s=0.021), far=256, repeats=1, refresh=True) == pytest.approx(
        0.005, rel=0.4)


class _Reading(ReferenceBackend):
    """A reference model whose forwards take a base 2 ms plus 0.1 ms per token."""

    def eval(self, tokens, rows="last"):
        import time

        time.sleep(0.002 + 0.0001 * len(tokens))
        return super().eval(tokens, rows)


def test_calibration_keeps_a_cached_profile_and_times_only_the_missing_k(monkeypatch, tmp_path):
    """A profile cached without some k (made by an older version, which timed up to 16, or by
    `edgespec profile --max-k 4`) keeps what it has: only the missing k are timed, beside the largest
    cached k as an anchor, and put in the cached timings' units."""
    from edgespec.calibration import calibrate, load_profile, profile_path, save_profile

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    model = tmp_path / "model.bin"
    model.write_bytes(b"weights")
    backend = _Reading(8, n_ctx=512)  # 2 ms + 0.1 ms a token
    backend.path = str(model)
    cached = {1: 4.2, 2: 4.4, 4: 4.8}  # twice what it takes now: timed while the machine was busier
    save_profile(profile_path(backend), backend, t_forward_ms=cached)
    t = calibrate(backend, ks=(1, 2, 4, 8, 16))
    assert {k: t[k] for k in cached} == cached  # the careful timings stay as they were
    assert t[8] == pytest.approx(2 * (2.0 + 0.8), rel=0.25)  # timed now, in the cached units (× 2)
    assert t[16] == pytest.approx(2 * (2.0 + 1.6), rel=0.25)
    prof = load_profile(profile_path(backend))
    assert prof is not None and prof.t_forward_ms == t
    assert calibrate(backend, ks=(1, 2, 4, 8, 16)) == t  # all cached now: nothing is timed again


def test_a_calibration_with_set_repeats_times_just_that_after_the_context_asked(monkeypatch, tmp_path):
    """A draft model's cost prior (T(1), T(2)) is a few steps after a short context: no estimate
    pass, no speed check, no 64-token prefill (a first generation must not pay seconds for it)."""
    from edgespec.calibration import calibrate

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    model = tmp_path / "model.bin"
    model.write_bytes(b"weights")
    backend = _Reading(8, n_ctx=512)
    backend.path = str(model)
    evals: list[int] = []
    real_eval = backend.eval
    monkeypatch.setattr(backend, "eval", lambda tokens, rows="last": evals.append(len(tokens)) or real_eval(tokens, rows))
    t = calibrate(backend, ks=(1, 2), context=16, repeats=3)
    assert t[1] == pytest.approx(2.1, rel=0.3) and t[2] == pytest.approx(2.2, rel=0.3)
    # the 16-token prefill, a one-token warm-up, then 3 × (T(1), T(2)): nothing else
    assert evals == [16, 1] + [1, 2, 2, 1, 1, 2]


def test_read_cost_is_a_batched_reads_ms_per_token():
    backend = _Reading(8, n_ctx=512)
    ms = read_cost(backend)
    assert ms == pytest.approx((2.0 + 0.1 * READ_TOKENS) / READ_TOKENS, rel=0.3)  # 0.13, not a step's 2.1
    assert backend.n_past == 0


def test_expected_tau_truncates_cycles_of_a_longer_draft():
    drafted, accepted = [4, 4, 2, 0], [4, 1, 2, 0]  # full, partial, short draft, plain step
    assert expected_tau(accepted, drafted, 4) == pytest.approx((5 + 2 + 3 + 1) / 4)
    assert expected_tau(accepted, drafted, 1) == pytest.approx((2 + 2 + 2 + 1) / 4)
    assert expected_tau([], [], 3) == 1.0


def test_draft_time_and_json_roundtrip():
    prof = CostProfile("m.gguf", "ab" * 32, "llama.cpp", "0.3.36", 2, {1: 10.0, 2: 15.0, 3: 20.0},
                       draft_kind="draft-model", draft_per_token_ms=2.0)
    assert prof.t_draft(0) == 0 and prof.t_draft(2) == 4.0
    again = CostProfile.from_json(prof.to_json())
    assert again == prof and again.t_forward_ms[3] == 20.0


def test_cache_path_is_keyed_and_under_edgespec_home(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    p = cache_path("0123456789abcdef" * 4, "llama.cpp", 2, "0.3.36")
    assert p.parent == tmp_path / "profiles"
    assert "0123456789abcdef" in p.name and "t2" in p.name and "0.3.36" in p.name


@pytest.mark.real
def test_profile_command_on_smollm2(monkeypatch, tmp_path, smollm2_path):
    from edgespec.cli.app import app

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    args = ["profile", "--model", str(smollm2_path), "--max-k", "4", "--repeats", "1"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "ideal speedup" in result.output and "×" in result.output
    files = list((tmp_path / "profiles").glob("*.json"))
    assert len(files) == 1
    data = json.loads(files[0].read_text())
    assert sorted(int(k) for k in data["t_forward_ms"]) == [1, 2, 3, 4]
    assert data["context_ms"] is not None and "each cached token adds" in result.output
    again = CliRunner().invoke(app, args, env={"COLUMNS": "200"})  # second run reads T(k) from the cache
    assert again.exit_code == 0 and "from the cache" in again.output


def test_ideal_speedup_of_truncated_cycles():
    from edgespec.bench.profile import ideal_speedup_at

    prof = CostProfile("m", "0" * 64, "b", "v", 1, {1: 10.0, 2: 15.0, 3: 20.0}, draft_per_token_ms=1.0)
    cycles = [(2, 2), (0, 0)]  # a full draft, then a plain step (n-gram found nothing)
    # γ=2: tokens 3 + 1; cost (2·1 + 20) + (0 + 10)
    assert ideal_speedup_at(prof.t_forward_ms, prof.t_draft, cycles, 2) == pytest.approx(4 * 10 / 32)
    # γ=1: tokens 2 + 1; cost (1 + 15) + 10
    assert ideal_speedup_at(prof.t_forward_ms, prof.t_draft, cycles, 1) == pytest.approx(3 * 10 / 26)
    # with full drafts it is the formula E[τ]·T(1)/(T_draft(γ)+T(γ+1))
    assert ideal_speedup_at(prof.t_forward_ms, prof.t_draft, [(2, 2)], 2) == pytest.approx(3.0 * 10 / (2 + 20))
