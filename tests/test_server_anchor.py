"""bench/anchors/server_anchor.py's pure parts: arguments, request sequences, configs and commands,
records from `timings`, medians and paired ratios, the best llama-server n-gram type, text
mismatches. No server, no model, no binary."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "anchors" / "server_anchor.py"
_spec = importlib.util.spec_from_file_location("server_anchor", _PATH)
sa = importlib.util.module_from_spec(_spec)
sys.modules["server_anchor"] = sa
_spec.loader.exec_module(sa)
import server_report as sr  # noqa: E402 - on sys.path once server_anchor is loaded

HELP = """----- speculative params -----
--spec-type none,draft-simple,draft-eagle3,draft-dflash,draft-dspark,draft-mtp,ngram-cache,ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod
                                        comma-separated list of types of speculative decoding to use
"""


# -- arguments --------------------------------------------------------------------------------------


def test_defaults():
    a = sa.parse_args(["--target", "m.gguf"])
    assert a.suite == ["edit-session", "agent-loop"]
    assert a.spec_type == ["ngram-mod", "ngram-map-k", "ngram-cache"]
    assert (a.rounds, a.threads, a.ctx, a.max_sessions, a.max_tokens_cap) == (2, 2, 4096, None, None)


def test_short_run_options_and_repeats_kept_once():
    a = sa.parse_args(["--target", "m", "--suite", "agent-loop", "--suite", "agent-loop", "--max-sessions", "1",
                       "--max-tokens-cap", "16", "--rounds", "1", "--spec-type", "ngram-mod",
                       "--spec-type", "ngram-mod --spec-ngram-mod-n-min 8"])
    assert a.suite == ["agent-loop"] and (a.max_sessions, a.max_tokens_cap, a.rounds) == (1, 16, 1)
    assert a.spec_type == ["ngram-mod", "ngram-mod --spec-ngram-mod-n-min 8"]


@pytest.mark.parametrize("argv", [
    ["--rounds", "0"], ["--max-sessions", "0"], ["--max-tokens-cap", "0"], ["--suite", "nope"],
    ["--spec-type", "none"], ["--spec-type", "--spec-ngram-mod-n-min 8"], ["--no-llama", "--no-edgespec"],
])
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as e:
        sa.parse_args(["--target", "m", *argv])
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_spec_type_with_flags():
    assert sa.parse_spec_type("ngram-map-k") == ("llama:ngram-map-k", "ngram-map-k", [])
    name, kind, extra = sa.parse_spec_type("ngram-mod --spec-ngram-mod-n-min 8 --spec-ngram-mod-n-max 16")
    assert kind == "ngram-mod" and extra == ["--spec-ngram-mod-n-min", "8", "--spec-ngram-mod-n-max", "16"]
    assert name == "llama:ngram-mod --spec-ngram-mod-n-min 8 --spec-ngram-mod-n-max 16"


def test_supported_spec_types_from_help_both_forms():
    got = sa.supported_spec_types(HELP)
    assert {"ngram-mod", "ngram-map-k", "ngram-cache", "ngram-simple", "none"} <= got
    assert sa.supported_spec_types("--spec-type [none|ngram-cache|ngram-mod]\n") == {"none", "ngram-cache", "ngram-mod"}
    assert sa.supported_spec_types("usage: llama-server [options]") == set()


# -- request sequences ------------------------------------------------------------------------------


def _session(sid: str, cat: str, max_tokens: list[int]) -> dict:
    return {"id": sid, "category": cat, "source": "test",
            "turns": [{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": f"{sid} {k}"}],
                       "max_tokens": m, "expected": "x"} for k, m in enumerate(max_tokens, 1)]}


def test_load_suite_from_a_path(tmp_path):
    f = tmp_path / "s.jsonl"
    f.write_text("\n".join(json.dumps(s) for s in (_session("a", "edit", [64, 256]), _session("b", "edit", [32])))
                 + "\n\n", encoding="utf-8")
    got = sa.load_suite("edit-session", path=f)
    assert [s["id"] for s in got] == ["a", "b"]
    assert got[0]["turns"][1] == {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a 2"}],
                                  "max_tokens": 256}  # "expected" is not sent
    capped = sa.load_suite("edit-session", max_sessions=1, max_tokens_cap=100, path=f)
    assert [s["id"] for s in capped] == ["a"] and [t["max_tokens"] for t in capped[0]["turns"]] == [64, 100]
    assert [(r, c) for r, c, _ in sa.requests_of(capped)] == [("a/t1", "edit"), ("a/t2", "edit")]


def test_a_bad_session_file_is_one_line_naming_the_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"id": "a", "category": "c", "turns": []}\n', encoding="utf-8")
    with pytest.raises(sa.AnchorError, match=r"bad\.jsonl:1"):
        sa.load_suite("edit-session", path=f)


@pytest.mark.parametrize("suite", ["edit-session", "agent-loop"])
def test_vendored_session_suites_load(suite):
    sessions = sa.load_suite(suite, max_sessions=2, max_tokens_cap=16)
    assert len(sessions) == 2
    for s in sessions:
        for t in s["turns"]:
            assert t["max_tokens"] <= 16 and t["messages"][-1]["role"] == "user"


def test_spec_bench_is_one_turn_sessions():
    sessions = sa.load_suite("spec-bench", per_category=1)
    assert len(sessions) == 6 and all(len(s["turns"]) == 1 for s in sessions)
    assert len({s["category"] for s in sessions}) == 6


def test_unknown_suite():
    with pytest.raises(sa.AnchorError, match="unknown suite"):
        sa.load_suite("nope")


# -- configs, order, commands -----------------------------------------------------------------------


def test_configs_skip_types_the_binary_lacks_and_alternate():
    a = sa.parse_args(["--target", "m", "--spec-type", "ngram-mod", "--spec-type", "ngram-future", "--edgespec-ngram"])
    configs, skipped = sa.make_configs(a, sa.supported_spec_types(HELP))
    names = [c.name for c in configs]
    assert names == ["llama:plain", "llama:ngram-mod", "edgespec:plain", "edgespec:history", "edgespec:ngram"]
    assert len(skipped) == 1 and "ngram-future" in skipped[0]
    assert [c.name for c in sa.round_order(configs, 1)] == names[::-1]
    assert sa.round_order(configs, 2) == configs


def test_only_filters_and_rejects_unknown_names():
    a = sa.parse_args(["--target", "m", "--only", "llama:plain", "--only", "edgespec:history"])
    configs, _ = sa.make_configs(a, None)
    assert [c.name for c in configs] == ["llama:plain", "edgespec:history"]
    a = sa.parse_args(["--target", "m", "--only", "llama:typo"])
    with pytest.raises(sa.AnchorError, match="no such config"):
        sa.make_configs(a, None)


def test_commands_share_target_threads_context():
    a = sa.parse_args(["--target", "m", "--threads", "3", "--ctx", "2048",
                       "--spec-type", "ngram-mod --spec-ngram-mod-n-min 8"])
    configs, _ = sa.make_configs(a, None)
    by = {c.name: c for c in configs}
    llama = sa.command(by["llama:ngram-mod --spec-ngram-mod-n-min 8"], a, "/m.gguf", 1234, "/bin/llama-server",
                       ["edgespec"])
    assert llama[:2] == ["/bin/llama-server", "-m"] and llama[-4:] == ["--spec-type", "ngram-mod",
                                                                        "--spec-ngram-mod-n-min", "8"]
    for flags in (["-t", "3"], ["-tb", "3"], ["-c", "2048"], ["-np", "1"], ["--port", "1234"], ["-ctk", "q8_0"]):
        assert " ".join(flags) in " ".join(llama)
    plain = sa.command(by["llama:plain"], a, "/m.gguf", 1, "/bin/llama-server", [])
    assert "--spec-type" not in plain
    es = sa.command(by["edgespec:history"], a, "/m.gguf", 1234, None, ["/venv/edgespec"])
    assert es[:2] == ["/venv/edgespec", "serve"]
    joined = " ".join(es)
    for part in ("--target /m.gguf", "--threads 3", "--ctx 2048", "--temp 0", "--history global",
                 "--drafter history -k auto", "--port 1234", "--host 127.0.0.1"):
        assert part in joined
    assert "--no-spec" in sa.command(by["edgespec:plain"], a, "/m.gguf", 1, None, ["e"])
    native = sa.parse_args(["--target", "m", "--native-defaults"])
    assert "--no-repack" not in sa.command(sa.Config("llama:plain", sa.LLAMA, False), native, "/m", 1, "/b", [])


def test_missing_binary_and_model_are_one_line_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    monkeypatch.delenv("EDGESPEC_LLAMA_SERVER_BIN", raising=False)
    with pytest.raises(sa.AnchorError, match="build.sh llama-server"):
        sa.find_llama_server(None)
    with pytest.raises(sa.AnchorError, match="not an executable"):
        sa.find_llama_server(str(tmp_path / "nope"))
    with pytest.raises(sa.AnchorError, match="model not found"):
        sa.resolve_target(str(tmp_path / "missing.gguf"))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "x.gguf").write_bytes(b"GGUF")
    assert sa.resolve_target("x.gguf") == str((tmp_path / "models" / "x.gguf").resolve())


# -- records ----------------------------------------------------------------------------------------

LP, LM, LK = (sa.Config("llama:plain", sa.LLAMA, False), sa.Config("llama:ngram-mod", sa.LLAMA, True),
              sa.Config("llama:ngram-map-k", sa.LLAMA, True))
EP, EH = sa.Config("edgespec:plain", sa.EDGESPEC, False), sa.Config("edgespec:history", sa.EDGESPEC, True)


def _resp(text: str, **timings) -> dict:
    return {"choices": [{"message": {"content": text}, "finish_reason": "stop"}],
            "usage": {"completion_tokens": timings.get("predicted_n", 0)}, "timings": timings}


def test_record_tau_llama_server_first_token_is_free():
    # 21 tokens: 1 from the prompt pass, 20 from decode passes, 15 of them accepted drafts -> 5 passes
    r = sa.record(LM, "s", 0, "a/t1", "c", 32, _resp("x", predicted_n=21, predicted_ms=100.0,
                                                     predicted_per_second=200.0, draft_n=18, draft_n_accepted=15), 0.2)
    assert r["tau"] == pytest.approx(20 / 5) and r["tau_source"] == "derived"
    assert r["acceptance"] == pytest.approx(15 / 18) and r["tok_per_s"] == 200.0 and r["round"] == 1


def test_record_llama_spec_without_drafts_and_edgespec_tau_from_the_server():
    r = sa.record(LK, "s", 0, "a/t1", "c", 32, _resp("x", predicted_n=11, predicted_ms=50.0,
                                                     predicted_per_second=200.0), 0.1)
    assert (r["draft_n"], r["draft_n_accepted"], r["tau"], r["acceptance"]) == (0, 0, 1.0, None)
    e = sa.record(EH, "s", 1, "a/t1", "c", 32, _resp("x", predicted_n=20, predicted_ms=50.0, predicted_per_second=400.0,
                                                     draft_n=12, draft_n_accepted=10, tau=2.0), 0.1)
    assert e["tau"] == 2.0 and e["tau_source"] == "server" and e["round"] == 2
    p = sa.record(LP, "s", 0, "a/t1", "c", 32, _resp("x", predicted_n=5, predicted_ms=5.0, predicted_per_second=800.0), 0)
    assert p["tau"] == 1.0 and p["draft_n"] is None
    none = sa.record(LP, "s", 0, "a/t1", "c", 32, {"choices": [{"message": {"content": "x"}}]}, 0)
    assert none["has_timings"] is False and none["tok_per_s"] == 0.0


# -- summary ----------------------------------------------------------------------------------------


def _rec(cfg, request, rnd, tok_s, cat="c", suite="s", text="same", n=101, drafted=None, accepted=None):
    tm = {"predicted_n": n, "predicted_ms": 1000.0 * (n - (cfg.impl == sa.LLAMA)) / tok_s,
          "predicted_per_second": tok_s}
    if drafted is not None:
        tm.update(draft_n=drafted, draft_n_accepted=accepted)
    return sa.record(cfg, suite, rnd, request, cat, 128, _resp(text, **tm), 1.0)


def _records():
    rs = []
    # two requests x two rounds; round 2 is a slow machine minute (every speed halved): ratios hold
    for rnd, f in ((0, 1.0), (1, 0.5)):
        for req, cat in (("a/t1", "x"), ("b/t1", "y")):
            rs += [_rec(LP, req, rnd, 100 * f, cat), _rec(LM, req, rnd, 150 * f, cat, drafted=80, accepted=60),
                   _rec(LK, req, rnd, (120 if cat == "x" else 180) * f, cat, drafted=50, accepted=40),
                   _rec(EP, req, rnd, 90 * f, cat), _rec(EH, req, rnd, 180 * f, cat, drafted=90, accepted=80)]
    return rs


def _row(summary, config, cat):
    return next(r for r in summary["rows"] if r["config"] == config and r["category"] == cat)


def test_summary_medians_speedups_and_cross_ratios():
    s = sa.summarise(_records())
    mod_x = _row(s, "llama:ngram-mod", "x")
    assert mod_x["n_requests"] == 2 and mod_x["speedup"] == pytest.approx(1.5)
    assert mod_x["tok_per_s"] == pytest.approx(112.5)  # median of 150 and 75
    assert mod_x["acceptance"] == pytest.approx(0.75)
    assert mod_x["pooled_tok_per_s"] == pytest.approx(200 / (100 / 150 + 100 / 75))
    hist = _row(s, "edgespec:history", "x")
    assert hist["speedup"] == pytest.approx(2.0)  # ÷ edgespec:plain, not ÷ llama:plain
    assert hist["vs_llama_plain"] == pytest.approx(1.8)
    # best llama n-gram type by median tok/s: ngram-mod on x (150 > 120), ngram-map-k on y (180 > 150),
    # ngram-mod over all (median 112.5 of 150, 150, 75, 75 > 105 of 120, 180, 60, 90)
    assert s["best_llama"] == {"s/x": "llama:ngram-mod", "s/y": "llama:ngram-map-k", "s/all": "llama:ngram-mod"}
    assert hist["best_llama"] == "llama:ngram-mod" and hist["vs_best_llama"] == pytest.approx(1.2)
    assert _row(s, "edgespec:history", "y")["vs_best_llama"] == pytest.approx(1.0)
    everything = _row(s, "edgespec:history", sr.ALL)
    assert everything["n_requests"] == 4 and everything["speedup"] == pytest.approx(2.0)
    assert "vs_best_llama" not in _row(s, "edgespec:plain", "x")  # cross ratios: speculative edgespec only
    assert _row(s, "llama:plain", "x")["speedup"] is None


def test_best_llama_type_choice():
    rows = [{"impl": sa.LLAMA, "spec": True, "suite": "s", "category": "c", "config": "llama:a", "tok_per_s": 10.0},
            {"impl": sa.LLAMA, "spec": True, "suite": "s", "category": "c", "config": "llama:b", "tok_per_s": 12.0},
            {"impl": sa.LLAMA, "spec": False, "suite": "s", "category": "c", "config": "llama:plain", "tok_per_s": 99.0},
            {"impl": sa.EDGESPEC, "spec": True, "suite": "s", "category": "c", "config": "edgespec:history",
             "tok_per_s": 50.0},
            {"impl": sa.LLAMA, "spec": True, "suite": "s", "category": "d", "config": "llama:a", "tok_per_s": None}]
    assert sr.best_llama_types(rows) == {("s", "c"): "llama:b"}


def test_summary_without_a_plain_server_has_no_speedup():
    rs = [r for r in _records() if r["config"] != "edgespec:plain"]
    s = sa.summarise(rs)
    assert _row(s, "edgespec:history", "x")["speedup"] is None
    assert _row(s, "llama:ngram-mod", "x")["speedup"] == pytest.approx(1.5)


def test_requests_without_speed_are_left_out_of_medians():
    rs = _records() + [sa.record(LM, "s", 0, "c/t1", "x", 8, _resp("z", predicted_n=1, predicted_ms=0.001,
                                                                     predicted_per_second=0.0), 0.1)]
    row = _row(sa.summarise(rs), "llama:ngram-mod", "x")
    assert row["n_requests"] == 3 and row["n_timed"] == 2 and row["tok_per_s"] == pytest.approx(112.5)


def test_text_mismatches_between_implementations_and_against_own_plain():
    rs = _records()
    for r in rs:
        if r["config"] == "edgespec:plain" and r["request"] == "a/t1" and r["round"] == 1:
            r["text"] = "same but other"
        if r["config"] == "llama:ngram-mod" and r["request"] == "b/t1" and r["round"] == 2:
            r["text"] = "sane"
    mm = sa.text_mismatches(rs)
    assert {(m["a"], m["b"], m["request"], m["round"]) for m in mm} == {
        ("llama:plain", "edgespec:plain", "a/t1", 1),
        ("edgespec:plain", "edgespec:history", "a/t1", 1),  # history still says "same": differs from its plain
        ("llama:plain", "llama:ngram-mod", "b/t1", 2)}
    m = next(m for m in mm if m["b"] == "llama:ngram-mod")
    assert m["at_char"] == 2 and m["a_text"] == "same" and m["b_text"] == "sane"


def test_markdown_table():
    rs = _records()
    md = sa.markdown(sa.summarise(rs), sa.text_mismatches(rs), 2)
    assert md.startswith("### s (medians over requests × 2 rounds)")
    line = next(ln for ln in md.splitlines() if ln.startswith("| x | edgespec:history"))
    assert "| 2.00 |" in line and "**1.20** (ngram-mod)" in line
    assert md.splitlines()[-1].startswith("Greedy text mismatches: llama:plain vs edgespec:plain 0;")


def test_free_port_is_a_loopback_port():
    assert 0 < sa.free_port() < 65536
