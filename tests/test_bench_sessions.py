"""Session suites (bench/sessions): the format's one-line errors, the two vendored suites and their
limits, and the bench running sessions: the drafter cold at each session's start only, history carried
from turn to turn within a session and never across sessions, greedy spec == plain on every turn."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

import edgespec.bench.run as bench_run
from edgespec.backends.reference import ReferenceBackend
from edgespec.bench import report
from edgespec.bench.run import Config, Run, by_turn, run_matrix
from edgespec.bench.sessions import HERE, SUITES, Session, as_session, cap_tokens, load_sessions, plain_prompt
from edgespec.bench.tasks import Task
from edgespec.cli import bench_cmd
from edgespec.drafters.history import HistoryDrafter
from edgespec.engine import Engine
from edgespec.errors import EdgespecError

USER = [{"role": "user", "content": "Hi?"}]
GOOD = {"id": "s-01", "category": "edit_session", "source": "written for this test",
        "turns": [{"messages": USER, "max_tokens": 32}, {"messages": USER, "max_tokens": 16, "expected": "Hello."}]}
MAX_PROMPT_TOKENS, MAX_ANSWER_TOKENS = 1200, 256
CHARS_PER_TOKEN, ROUGH = 3.5, 1.1  # a rough count, ±10%; test_suites_fit_the_limits_in_smollm2_tokens counts exactly


# -- the format -----------------------------------------------------------------------------------------


def _write(tmp_path: Path, *lines: object) -> Path:
    path = tmp_path / "sessions.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_a_good_session_loads(tmp_path: Path) -> None:
    (s,) = load_sessions(_write(tmp_path, GOOD))
    assert (s.id, s.category, s.source, s.expected) == ("s-01", "edit_session", "written for this test", (None, "Hello."))
    assert [t.id for t in s.turns] == ["s-01/t1", "s-01/t2"]
    assert [t.max_tokens for t in s.turns] == [32, 16] and {t.category for t in s.turns} == {"edit_session"}
    assert s.turns[0].prompt == plain_prompt(USER) == "User: Hi?\n\nAssistant:"


def _turn(**kw: object) -> dict:
    return {**GOOD, "turns": [GOOD["turns"][0], {**GOOD["turns"][1], **kw}]}


@pytest.mark.parametrize(("line", "expected"), [
    ('{"id": "s-02", ', "bad JSON"),
    ([1], "expected a JSON object, got list"),
    ({k: v for k, v in GOOD.items() if k != "source"}, "missing key(s) 'source'"),
    ({**GOOD, "prompt": "x"}, "unknown key(s) 'prompt'"),
    ({**GOOD, "id": "a/b"}, "'id' must not contain '/'"),
    ({**GOOD, "category": ""}, "'category' must be a non-empty string"),
    ({**GOOD, "turns": []}, "'turns' must be a non-empty list"),
    ({**GOOD, "turns": "x"}, "'turns' must be a non-empty list"),
    ({**GOOD, "turns": [GOOD["turns"][0], 3]}, "turns[1] must be an object"),
    ({**GOOD, "turns": [{"messages": USER}]}, "turns[0]: missing key(s) 'max_tokens'"),
    (_turn(reply="x"), "turns[1]: unknown key(s) 'reply'"),
    (_turn(max_tokens=0), "turns[1]: 'max_tokens' is 0, out of range"),
    (_turn(max_tokens=1.5), "turns[1]: 'max_tokens' must be an integer (got float)"),
    (_turn(expected=""), "turns[1]: 'expected' must be a non-empty string"),
    (_turn(messages=[]), "turns[1]: 'messages' must be a non-empty list"),
    (_turn(messages=[{"role": "tool", "content": "x"}]), "turns[1]: messages[0] has role 'tool'"),
    (_turn(messages=[*USER, {"role": "assistant", "content": "x"}]), "turns[1]: the last message must have role 'user'"),
    (GOOD, "duplicate session id 's-01' (first at"),
])
def test_malformed_session_names_file_line_and_problem(tmp_path: Path, line: object, expected: str) -> None:
    path = _write(tmp_path, GOOD, line)
    with pytest.raises(EdgespecError) as info:
        load_sessions(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}:2: ") and expected in message, message


def test_categories_caps_and_missing_files(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD, {**GOOD, "id": "s-02", "category": "other"})
    assert [s.id for s in load_sessions(path, ["other"])] == ["s-02"]
    with pytest.raises(EdgespecError, match=r"^no sessions in category 'nope' \(available: edit_session, other\)$"):
        load_sessions(path, ["nope"])
    capped = cap_tokens(load_sessions(path)[0], 20)
    assert [t.max_tokens for t in capped.turns] == [20, 16]
    with pytest.raises(EdgespecError, match="cannot read session file"):
        load_sessions(tmp_path / "absent.jsonl")
    with pytest.raises(EdgespecError, match="^no sessions in"):
        load_sessions(_write(tmp_path, ""))
    task = Task("t", "c", tuple(USER), "p", 8)
    assert as_session(task) == Session("t", "c", (task,)) and cap_tokens(task, 4).max_tokens == 4


# -- the vendored suites --------------------------------------------------------------------------------


@pytest.mark.parametrize("suite", list(SUITES))
def test_suites_load_within_limits(suite: str) -> None:
    sessions = load_sessions(suite)
    assert len(sessions) == 6 and len({s.category for s in sessions}) == 1
    for s in sessions:
        assert 3 <= len(s.turns) <= 5 and all(s.expected), s.id
        for turn, answer in zip(s.turns, s.expected, strict=True):
            chars = sum(len(m["content"]) + 16 for m in turn.messages)  # + a chat template's role markers
            assert chars / CHARS_PER_TOKEN <= MAX_PROMPT_TOKENS * ROUGH, turn.id
            assert turn.max_tokens <= MAX_ANSWER_TOKENS, turn.id
            assert len(answer) / CHARS_PER_TOKEN <= MAX_ANSWER_TOKENS * ROUGH, turn.id
            assert len({m["content"] for m in turn.messages if m["role"] == "system"}) == 1


def test_edit_sessions_send_the_file_as_edited_so_far() -> None:
    """Turn k's expected file is the file turn k+1 sends; the Python versions parse; several languages."""
    languages = set()
    for s in load_sessions("edit-session"):
        files = [_code(t.messages[-1]["content"]) for t in s.turns] + [_code(s.expected[-1])]
        for turn, answer, nxt in zip(s.turns, s.expected, files[1:]):
            assert _code(answer) == nxt, turn.id
            assert len(turn.messages) == 2 and "Change: " in turn.messages[-1]["content"]
        for lang, code in files:
            languages.add(lang)
            if lang == "python":
                ast.parse(code)
        assert len({code for _, code in files}) == len(files), s.id  # every turn changes the file
    assert "python" in languages and len(languages) >= 3


def _code(text: str) -> tuple[str, str]:
    lang, code = re.search(r"```(\w+)\n(.*)```", text, re.S).groups()
    return lang, code


def test_agent_sessions_grow_by_the_expected_calls() -> None:
    """Turn k+1 = turn k's messages + the expected call + its tool result: one conversation, fixed in
    advance, every call a JSON object naming a tool the system prompt lists."""
    for s in load_sessions("agent-loop"):
        for turn, answer, nxt in zip(s.turns, s.expected, [*s.turns[1:], None]):
            call = json.loads(answer)
            assert set(call) == {"name", "arguments"} and f'"name": "{call["name"]}"' in turn.messages[0]["content"]
            if nxt is not None:
                assert nxt.messages[:len(turn.messages)] == turn.messages, turn.id
                assert nxt.messages[len(turn.messages)] == {"role": "assistant", "content": answer}
                assert json.loads(nxt.messages[len(turn.messages) + 1]["content"].split("\n\n")[0])["tool"] == call["name"]
            roles = [m["role"] for m in turn.messages]
            assert roles[0] == "system" and all(a != b for a, b in zip(roles[1:], roles[2:]))


def test_sources_and_licenses_are_named() -> None:
    readme = (HERE / "README.md").read_text(encoding="utf-8")
    licenses = {p.name for p in (HERE / "licenses").iterdir()}
    assert {"gorilla-LICENSE", "requests-LICENSE", "requests-NOTICE", "click-LICENSE", "lodash-LICENSE",
            "golang-sync-LICENSE", "ripgrep-LICENSE-MIT", "more-itertools-LICENSE"} <= licenses
    for suite in SUITES:
        for s in load_sessions(suite):
            assert s.id in readme and s.source
            commit = re.search(r"@([0-9a-f]{40})", s.source)
            assert commit is None or commit.group(1) in readme, s.id
    assert "6ea57973c7a6097fd7c5915698c54c17c5b1b6c8" in readme  # BFCL's commit


@pytest.mark.real
def test_suites_fit_the_limits_in_smollm2_tokens(tiny_target: Path) -> None:
    """The same limits counted with SmolLM2's tokenizer and chat template (tiny_target copies both)."""
    from edgespec.backends.llama_cpp import LlamaCppBackend
    from edgespec.chat import chat_prompt

    with LlamaCppBackend(tiny_target, n_ctx=256, threads=1) as target:
        for suite in SUITES:
            for s in load_sessions(suite):
                for turn, answer in zip(s.turns, s.expected):
                    text, bos = chat_prompt(target, list(turn.messages))
                    assert len(target.tokenize(text, bos, True)) <= MAX_PROMPT_TOKENS, turn.id
                    assert len(target.tokenize(answer, False, False)) <= turn.max_tokens <= MAX_ANSWER_TOKENS, turn.id


# -- the bench ------------------------------------------------------------------------------------------


class Counting(HistoryDrafter):
    """A HistoryDrafter that counts clear() calls and records each draft: (context length, tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.clears, self.drafts = 0, []

    def clear(self) -> None:
        self.clears = getattr(self, "clears", 0) + 1
        super().clear()

    def draft(self, context, gamma, params, rng, stop=None):
        d = super().draft(context, gamma, params, rng, stop)
        self.drafts.append((len(context), list(d.tokens)))
        return d


def _session(sid: str, *prompts: str, max_tokens: int = 40) -> Session:
    turns = tuple(Task(f"{sid}/t{k}", "s", ({"role": "user", "content": p},), p, max_tokens)
                  for k, p in enumerate(prompts, 1))
    return Session(sid, "s", turns)


def test_sessions_alternate_per_turn_and_start_cold_once_per_session() -> None:
    engine, drafter = Engine(ReferenceBackend(6, seed=5)), Counting()
    sessions = [_session("a", "fedcb", "abcab", "cafe"), _session("b", "decaf", "faced")]
    configs = [Config("history", 3), Config("history", "auto")]
    runs = run_matrix(engine, {"history": drafter}, configs, sessions, [0.0], 1, chat=False)
    assert drafter.clears == len(sessions) * len(configs)  # per session and config, not per turn
    assert [(r.task, r.config, r.turn) for r in runs[:6]] == [
        ("a/t1", "plain", 1), ("a/t1", "history k=3", 1), ("a/t2", "plain", 2), ("a/t2", "history k=3", 2),
        ("a/t3", "plain", 3), ("a/t3", "history k=3", 3)]
    assert len(runs) == (3 + 2) * len(configs) * 2 and all(r.matches_plain for r in runs if r.config != "plain")


def _history_runs(engine: Engine, sessions: list, chat: bool, repeats: int = 1) -> tuple[list[Run], Counting]:
    drafter = Counting()
    runs = run_matrix(engine, {"history": drafter}, [Config("history", 4)], sessions, [0.0], repeats, chat)
    assert all(r.matches_plain for r in runs if r.config != "plain")  # lossless on every turn
    return [r for r in runs if r.config != "plain"], drafter


def _accepted(r: Run) -> int:
    return sum(n for _, n in r.cycles)


@pytest.fixture(params=["reference", pytest.param("tiny", marks=pytest.mark.real)])
def engine_chat(request):
    """(engine, chat, a prompt): the reference oracle (plain prompts of letters) or tiny_target (a
    2-layer random llama with SmolLM2's tokenizer and chat template)."""
    if request.param == "reference":
        yield Engine(ReferenceBackend(6, seed=5)), False, "fedcbafcd"
        return
    from edgespec.backends.llama_cpp import LlamaCppBackend

    with Engine(LlamaCppBackend(request.getfixturevalue("tiny_target"), n_ctx=512, threads=1)) as engine:
        yield engine, True, "Rename the function calc to total and return the whole file."


def test_single_shot_runs_start_cold(engine_chat, monkeypatch) -> None:
    """A task run twice (two repeats) drafts the same both times; without the clearing the second
    repeat finds the first one's prompt and output in the history and accepts more."""
    engine, chat, prompt = engine_chat
    task = _session("t", prompt).turns[0]
    first, second = _history_runs(engine, [task], chat, repeats=2)[0]
    assert first.cycles == second.cycles and first.tau == second.tau
    monkeypatch.setattr(bench_run, "start_cold", lambda drafter: None)
    first, second = _history_runs(engine, [task], chat, repeats=2)[0]
    assert _accepted(second) > _accepted(first)


def test_history_carries_within_a_session_never_across(engine_chat) -> None:
    """Two sessions of the same two identical requests: in each, turn 2's first draft is turn 1's
    output (tokens only turn 1's output held) and it accepts more; the second session repeats the
    first exactly, so nothing of the first session reached it."""
    engine, chat, prompt = engine_chat
    runs, drafter = _history_runs(engine, [_session("a", prompt, prompt), _session("b", prompt, prompt)], chat)
    a1, a2, b1, b2 = runs
    assert [r.task for r in runs] == ["a/t1", "a/t2", "b/t1", "b/t2"]
    assert _accepted(a2) > _accepted(a1) and a2.cycles != a1.cycles
    assert (b1.cycles, b2.cycles) == (a1.cycles, a2.cycles)
    # the spec side of a turn: prompt, then drafts; turn 2's first draft comes right after its prompt
    drafts = _turn_drafts(drafter.drafts)
    output_a1 = _output(engine, chat, prompt, a1)
    first = drafts[1][0][1]
    assert first and output_a1[:len(first)] == first


def _turn_drafts(drafts: list[tuple[int, list[int]]]) -> list[list[tuple[int, list[int]]]]:
    """The recorded drafts split into generations (a context shorter than the one before starts one)."""
    out: list[list] = []
    for n, tokens in drafts:
        if not out or n < out[-1][-1][0]:
            out.append([])
        out[-1].append((n, tokens))
    return out


def _output(engine: Engine, chat: bool, prompt: str, run: Run) -> list[int]:
    """The greedy tokens of `prompt` (what run's turn emitted: spec == plain)."""
    engine.reset()
    kw = dict(max_tokens=run.n_tokens, temperature=0.0, speculative=False)
    gen = engine.chat([{"role": "user", "content": prompt}], **kw) if chat else engine.generate(prompt, **kw)
    return gen.tokens


def test_by_turn_rows_and_report() -> None:
    def run(config: str, turn: int, tok_s: float, cycles: list) -> Run:
        return Run("s/t", "c", config, 0.0, 0, tok_s, sum(n + 1 for _, n in cycles), 1.0, 0.0, 1.0, 0.0, 1.0,
                   cycles, plain_tok_per_s=10.0 if config != "plain" else None, turn=turn)

    assert by_turn([run("h k=4", 1, 12.0, [(4, 1)])]) == []  # single-shot tasks: no by-turn rows
    runs = [run("h k=4", 1, 12.0, [(4, 1)]), run("h k=4", 2, 20.0, [(4, 4)]), run("h k=4", 2, 30.0, [(4, 4)]),
            run("plain", 2, 10.0, [(0, 0)])]
    rows = by_turn(runs)
    assert [(r["turn"], r["n"], r["speedup_median"], r["tau"]) for r in rows] == [(1, 1, 1.2, 2.0), (2, 2, 2.5, 5.0)]
    meta = dict(command="edgespec bench", target="ref", threads=1, sha256={"ref": "0" * 64},
                env=dict(platform="p", machine="m", edgespec="0", llama_cpp="0", date="d"))
    md = report.markdown(meta, bench_run.summarize(runs), turns=rows)
    assert "| config | turn 1 | turn 2 |" in md and "| h k=4 | 1.20 (2.00) | 2.50 (5.00) |" in md


def test_cli_selects_session_suites() -> None:
    sessions = bench_cmd._select("agent-loop", None, None, 2, 16)
    assert [s.id for s in sessions] == ["agent-01", "agent-02"]
    assert {t.max_tokens for s in sessions for t in s.turns} == {16}
    assert len(bench_cmd._select("edit-session", None, ["edit_session"], 3, None)) == 3
    with pytest.raises(EdgespecError, match=r"^no sessions in category 'chat' \(available: agent_loop\)$"):
        bench_cmd._select("agent-loop", None, ["chat"], 3, None)
    assert set(SUITES) <= set(bench_cmd.SUITES)


@pytest.mark.real
def test_bench_cli_runs_a_session_suite(tiny_target: Path, tmp_path: Path, monkeypatch) -> None:
    """`edgespec bench --suite agent-loop` on tiny_target: every turn of one session, plain and history
    alternating, lossless, and the by-turn table in results.md."""
    from typer.testing import CliRunner

    from edgespec.cli.app import app

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "home"))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["bench", "--target", str(tiny_target), "--suite", "agent-loop", "--drafter",
                                      "history", "-k", "3", "--max-tokens", "8", "--per-category", "1",
                                      "--threads", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "results.json").read_text())
    spec = [r for r in data["runs"] if r["config"] != "plain"]
    assert [r["task"] for r in spec] == [f"agent-01/t{k}" for k in range(1, 6)] and all(r["matches_plain"] for r in spec)
    assert [r["turn"] for r in data["by_turn"]] == [1, 2, 3, 4, 5] and data["meta"]["tasks"] == ["agent-01"]
    assert "Sessions, by turn" in (out / "results.md").read_text()
