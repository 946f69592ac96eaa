"""The bench harness on the reference backend: alternation, pairing, summaries, reports."""

from __future__ import annotations

import json

import pytest

from edgespec.backends.reference import ReferenceBackend
from edgespec.bench import report
from edgespec.bench.run import Config, acceptance_by_position, run_matrix, summarize
from edgespec.bench.tasks import Task
from edgespec.drafters.draft_model import DraftModelDrafter
from edgespec.drafters.ngram import NgramDrafter
from edgespec.engine import Engine
from edgespec.stats import Stats

TASKS = [Task(f"{c}-0{i}", c, ({"role": "user", "content": "x"},), p, 40)
         for c, p in (("copy", "abcabcabcab"), ("free", "fedcb")) for i in (1, 2)]


def _engine():
    target = ReferenceBackend(6, seed=5)
    drafters = {"ngram": NgramDrafter(), "draft": DraftModelDrafter(target.perturbed(0.5), 6)}
    return Engine(target), drafters


def test_runs_alternate_plain_and_spec_and_greedy_matches():
    engine, drafters = _engine()
    seen = []
    configs = [Config("ngram", 3), Config("draft", 2)]
    runs = run_matrix(engine, drafters, configs, TASKS, [0.0, 0.8], 2, chat=False, on_run=seen.append)
    assert len(runs) == len(TASKS) * 2 * 2 * len(configs) * 2
    assert [r.config for r in runs[:4]] == ["plain", "ngram k=3", "plain", "draft k=2"]  # A B A B
    specs = [r for r in runs if r.config != "plain"]
    assert all(r.plain_tok_per_s for r in specs)
    assert all(r.matches_plain for r in specs if r.temperature == 0)  # lossless on the oracle
    assert all(r.matches_plain is None for r in specs if r.temperature > 0)
    assert seen == runs


def test_summary_rows_per_category_and_overall(tmp_path):
    engine, drafters = _engine()
    runs = run_matrix(engine, drafters, [Config("ngram", 4)], TASKS, [0.0], 1, chat=False)
    summary = summarize(runs, t_forward_ms={k: 1.0 + 0.5 * (k - 1) for k in range(1, 17)})
    cats = {r["category"] for r in summary}
    assert cats == {"copy", "free", "all"}
    for r in summary:
        assert r["speedup_min"] <= r["speedup_median"] <= r["speedup_max"]
        assert r["mismatches"] == 0 and r["ideal_speedup"] > 0
        assert abs(sum(r["split"].values()) - 1) < 1e-9
    copy = next(r for r in summary if r["category"] == "copy")
    assert copy["tau"] > 1.0  # the repetitive prompt gets accepted drafts
    report.write_json(tmp_path / "results.json", META, summary, [])
    assert json.loads((tmp_path / "results.json").read_text())["summary"] == summary
    md = report.markdown(META, summary, ["speedup_t0.png"])
    assert "| **all** | ngram k=4 |" in md and "speedup_t0.png" in md


META = dict(command="edgespec bench", target="ref", threads=1, sha256={"ref": "0" * 64},
            env=dict(platform="p", machine="m", edgespec="0", llama_cpp="0", date="d"))


def test_wasted_verify_positions_per_token():
    # (drafted, accepted): rejected positions verified 0, 3 (position 2 and the two after it), 3, 0, 0
    # = 6; tokens emitted: accepted + 1 per cycle = 5 + 2 + 1 + 1 + 3 = 12
    s = Stats()
    for d, n in [(4, 4), (4, 1), (3, 0), (0, 0), (2, 2)]:
        s.record_cycle(d, n)
    s.n_tokens = 12
    assert s.n_wasted == 6 and s.wasted_per_token == pytest.approx(0.5)
    assert "wasted verify 0.50/token" in s.summary()
    both = s.merge(s)
    assert both.n_wasted == 12 and both.wasted_per_token == pytest.approx(0.5)
    assert Stats().wasted_per_token == 0.0


def test_acceptance_by_position_is_conditional():
    # (drafted, accepted): position 1 reached 4×, accepted 3×; position 2 reached 3× (one draft was short)
    cycles = [(3, 3), (3, 1), (1, 1), (2, 0), (0, 0)]
    acc = acceptance_by_position(cycles)
    assert acc[0] == pytest.approx(3 / 4)
    assert acc[1] == pytest.approx(1 / 2)  # reached by (3,3) and (3,1); accepted by (3,3)
    assert acc[2] == pytest.approx(1.0)


def test_config_labels():
    assert Config("ngram", 4).label == "ngram k=4"
    assert Config("/x/y/gemma.gguf", 2).label == "gemma.gguf k=2"


def _run(config, tok_s, plain, category="c", cycles=()):
    from edgespec.bench.run import Run

    n = sum(a + 1 for _, a in cycles) or 10
    return Run("t", category, config, 0.0, 0, tok_s, n, 1.0, 0.1, 0.8, 0.1, 100.0, list(cycles),
               plain_tok_per_s=plain, matches_plain=True)


def test_pairwise_ratios_and_ideal_against_hand_computation():
    runs = [_run("plain", 100, None), _run("ng k=2", 150, 100, cycles=[(2, 2), (0, 0)]),
            _run("plain", 80, None), _run("ng k=2", 60, 80, cycles=[(2, 1)]),
            _run("plain", 90, None), _run("ng k=2", 99, 90, cycles=[(1, 0)])]
    t = {1: 10.0, 2: 15.0, 3: 20.0}
    row = next(r for r in summarize(runs, t) if r["category"] == "all")
    assert (row["speedup_min"], row["speedup_median"], row["speedup_max"]) == pytest.approx((0.75, 1.1, 1.5))
    assert row["tok_per_s"] == 99 and row["plain_tok_per_s"] == 90
    # tokens: (3 + 1) + 2 + 1 = 7; cost: 20 + 10 + 20 + 15 = 65 (no draft cost given)
    assert row["ideal_speedup"] == pytest.approx(7 * 10 / 65)
    assert row["efficiency"] == pytest.approx(1.1 / (7 * 10 / 65))
    assert row["tau"] == pytest.approx(7 / 4)
    assert row["acceptance_by_position"] == pytest.approx([2 / 3, 1 / 2])
    # rejected positions verified: (2, 1) one, (1, 0) one = 2, over 7 tokens
    assert row["wasted_per_token"] == pytest.approx(2 / 7)
    md = report.markdown(META, [row])
    assert "| τ | wasted verify / token | efficiency |" in md
    assert "| 1.75 | 0.29 | " in md  # τ = 7/4, then 2/7 wasted per token
    # predicted memory-bound: T1 = 1000/90 ms (median plain), 5 drafted tokens in 3 × 0.1 s of drafting
    c = (300 / 5) / (1000 / 90)
    assert row["draft_cost_vs_t1"] == pytest.approx(c)
    assert row["predicted_memory_bound"] == pytest.approx(7 / (4 + 5 * c))


@pytest.mark.real
def test_bench_cli_writes_partial_results_on_ctrl_c(monkeypatch, tmp_path, smollm2_path):
    """Ctrl-C after two plain/spec pairs: the report of those pairs is still written (exit 130)."""
    from typer.testing import CliRunner

    import edgespec.bench.run as bench_run
    from edgespec.cli.app import app

    real = bench_run.run_matrix

    def interrupted(engine, drafters, configs, tasks, temps, repeats, chat, on_run, plain_engine=None):
        count = [0]

        def counting(r):
            on_run(r)
            count[0] += 1
            if count[0] == 4:
                raise KeyboardInterrupt

        return real(engine, drafters, configs, tasks, temps, repeats, chat, counting, plain_engine)

    monkeypatch.setattr(bench_run, "run_matrix", interrupted)
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))  # no cached profile: efficiency omitted
    # -k auto's cost prior: known costs instead of timing T(k) and the context term (two thirds of this
    # test unloaded; minutes on a busy machine), which nothing here asserts (the exact-batch check runs)
    from edgespec import calibration

    monkeypatch.setattr(calibration, "calibrate", lambda backend, ks=calibration.CALIBRATION_KS, **kw: {
        k: 1 + 0.1 * (k - 1) for k in ks})
    monkeypatch.setattr(calibration, "context_cost", lambda backend, **kw: 0.0)
    out = tmp_path / "out"
    # one llama.cpp thread, as the other real-model tests: two on this shared 2-core machine under load
    # are many times slower
    result = CliRunner().invoke(app, ["bench", "--target", str(smollm2_path), "--max-tokens", "16",
                                      "--per-category", "1", "--threads", "1", "--out", str(out)])
    assert result.exit_code == 130, result.output
    data = json.loads((out / "results.json").read_text())
    assert len(data["runs"]) == 4 and data["meta"]["interrupted_after"] == 4
    assert (out / "results.md").read_text().count("ngram k=4") >= 2
    env = data["meta"]["env"]  # provenance: the commit, date and CPU model, in the json and the md header
    assert {"commit", "date", "cpu"} <= set(env) and f"commit {env['commit']}" in (out / "results.md").read_text()


def test_k0_is_a_plain_vs_plain_control():
    """-k 0 pairs plain decoding with plain decoding: no drafts, the same tokens, τ 1, and a summary
    row like any config's (its ratio spread is the machine's noise)."""
    engine, drafters = _engine()
    runs = run_matrix(engine, drafters, [Config("ngram", 0)], TASKS, [0.0], 1, chat=False)
    ctl = [r for r in runs if r.config == "ngram k=0"]
    assert len(ctl) == len(TASKS) and all(r.matches_plain for r in ctl)
    assert all(d == 0 for r in ctl for d, _ in r.cycles) and all(r.tau == 1.0 for r in ctl)
    row = next(r for r in summarize(runs, t_forward_ms={k: 1.0 for k in range(1, 17)}) if r["category"] == "all")
    assert row["tau"] == 1.0 and row["speedup_min"] <= row["speedup_median"] <= row["speedup_max"]
