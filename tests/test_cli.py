"""The `edgespec` CLI: help without llama-cpp-python, one-line errors, streaming, the chat REPL."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_subprocess import run_cli_without
from typer.testing import CliRunner

from edgespec.cli import app as cli
from edgespec.engine import Chunk
from edgespec.stats import Stats

runner = CliRunner()

STATS_LINE = re.compile(r"^\d+ tokens · \d+\.\d tok/s( · τ \d+\.\d\d · acceptance (\d+%|– \(nothing drafted\)))?$")


def _run_without_llama(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli_without("llama_cpp", *args)


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


@pytest.mark.parametrize("args", [["--help"], ["generate", "--help"], ["chat", "--help"], ["demo", "--help"],
                                  ["models", "--help"], ["--version"]])
def test_help_without_llama_cpp(args: list[str]) -> None:
    proc = _run_without_llama(*args)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    if args == ["--help"]:
        assert all(cmd in proc.stdout for cmd in ("generate", "chat", "demo", "models"))
    if args[0] == "generate":
        assert all(flag in proc.stdout for flag in ("--target", "--drafter", "--num-draft", "--temp", "--no-spec"))
        assert "'edgespec[mlx]'" in proc.stdout  # the extra's name survives rich markup


@pytest.mark.parametrize(("args", "commands"), [
    ([], ("generate", "chat", "demo", "serve", "profile", "bench", "convert", "train-head", "models")),
    (["models"], ("fetch", "list")),
])
def test_help_lists_one_line_per_command(args: list[str], commands: tuple[str, ...]) -> None:
    """Each command's summary fits one line of an 80-column `--help`; its details are in its own --help."""
    result = runner.invoke(cli.app, [*args, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert result.exit_code == 0, result.output
    panel = result.output.split("Commands")[1].split("╰")[0].splitlines()[1:]
    rows = [ln.strip("│ ").split()[0] for ln in panel]
    assert rows == list(commands), panel  # a wrapped summary would add a row with no command name
    for name in commands:
        summary = next(ln for ln in panel if ln.strip("│ ").split()[0] == name).strip("│ ")[len(name):].strip()
        own = runner.invoke(cli.app, [*args, name, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
        assert own.exit_code == 0 and summary in own.output, own.output


def test_missing_llama_cpp_is_a_one_line_error(tmp_path: Path) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + bytes(64))
    proc = _run_without_llama("generate", "-p", "hi", "--target", str(model))
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    [line] = _lines(proc.stderr)
    assert line.startswith("error: ") and "llama-cpp-python" in line


def test_missing_model_file(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model.gguf"
    result = runner.invoke(cli.app, ["generate", "-p", "hi", "--target", str(missing)])
    assert result.exit_code == 1
    [line] = _lines(result.stderr)
    assert line.startswith("error: ") and str(missing) in line
    assert result.stdout == ""


@pytest.mark.parametrize(("args", "needle"), [
    (["--temp", "-1"], "temperature"),
    (["--top-p", "1.5"], "top_p"),
    (["--min-p", "1"], "min_p"),
    (["--top-k", "-2"], "top_k"),
    (["-k", "-1"], "--num-draft"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--tree", "8", "-k", "auto"], "forced draft trees"),
    (["--tree", "auto", "-k", "4"], "--tree auto prices trees under -k auto"),
    (["--tree", "wide"], "--tree must be"),
])
@pytest.mark.parametrize("command", ["generate", "chat", "demo"])
def test_invalid_sampling_flags(command: str, args: list[str], needle: str, tmp_path: Path) -> None:
    extra = ["-p", "hi"] if command == "generate" else []
    # The flags are checked before any model is loaded: the missing target is never reached.
    result = runner.invoke(cli.app, [command, *extra, "--target", str(tmp_path / "x.gguf"), *args])
    assert result.exit_code == 1
    [line] = _lines(result.stderr)
    assert line.startswith("error: ") and needle in line


def test_version() -> None:
    result = runner.invoke(cli.app, ["--version"])
    assert result.exit_code == 0 and result.stdout.startswith("edgespec ")


# -- commands against a fake engine (no model) ----------------------------------------------------


class FakeEngine:
    """Streams a fixed reply word by word; honours cancel() like Engine (checked before each cycle)."""

    WORDS = ["Hello", " there", ",", " friend", "."]

    def __init__(self, interrupt_calls: tuple[int, ...] = ()) -> None:
        self.target = SimpleNamespace(path="fake.gguf")
        self.drafter = SimpleNamespace(name="ngram")
        self.last_stats: Stats | None = None
        self.calls: list[tuple[object, dict]] = []
        self.interrupt_calls = interrupt_calls  # calls during which Ctrl-C is pressed after the 1st word
        self.resets = 0
        self.closed = False
        self._cancel = False
        self.timing = False  # an idle timing run (Engine.calibrate(background=True), after a first reply)

    def _reply(self, call: int) -> Iterator[Chunk]:
        self._cancel = False
        stats = self.last_stats = Stats(n_prompt=3)
        for i, word in enumerate(self.WORDS):
            if self._cancel:
                yield Chunk("", [], [], "cancelled")
                return
            stats.record_cycle(2, 1)
            stats.n_tokens, stats.t_verify = i + 1, 0.01 * (i + 1)
            yield Chunk(word, [i], [False], "eos" if i == len(self.WORDS) - 1 else None)
            if call in self.interrupt_calls and i == 0:
                signal.raise_signal(signal.SIGINT)

    def stream(self, prompt: object, **kw: object) -> Iterator[Chunk]:
        self.calls.append((prompt, kw))
        return self._reply(len(self.calls) - 1)

    def stream_chat(self, messages: list[dict], **kw: object) -> Iterator[Chunk]:
        self.calls.append(([dict(m) for m in messages], kw))
        return self._reply(len(self.calls) - 1)

    def chat(self, messages: list[dict], **kw: object) -> SimpleNamespace:
        text = "".join(c.text for c in self.stream_chat(messages, **kw))
        return SimpleNamespace(text=text, stats=self.last_stats)

    def cancel(self) -> None:
        self._cancel = True

    def reset(self) -> None:
        self.resets += 1

    def calibrate(self, note: object = None, background: bool = False) -> None:
        pass

    def __enter__(self) -> FakeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.closed = True


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeEngine:
    engine = FakeEngine()
    monkeypatch.setattr(cli.RunOptions, "load", lambda self, **kw: engine)
    return engine


def test_generate_streams_text_and_one_stats_line(fake: FakeEngine) -> None:
    result = runner.invoke(cli.app, ["generate", "-p", "hi", "--temp", "0.5", "--seed", "7", "-k", "3",
                                     "-n", "9", "--stop", "###"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "Hello there, friend.\n"
    [line] = _lines(result.stderr)
    assert STATS_LINE.match(line) and line.startswith("5 tokens") and "acceptance 50%" in line
    prompt, kw = fake.calls[0]
    assert prompt == "hi"
    assert kw == dict(max_tokens=9, temperature=0.5, top_k=0, top_p=1.0, min_p=0.0, seed=7, num_draft=3,
                      speculative=True, stop=("###",))
    assert fake.closed


def test_generate_reads_stdin_and_applies_chat_template(fake: FakeEngine) -> None:
    result = runner.invoke(cli.app, ["generate", "--chat", "--no-spec"], input="what is 2+2?\n")
    assert result.exit_code == 0, result.output
    messages, kw = fake.calls[0]
    assert messages == [{"role": "user", "content": "what is 2+2?"}]
    assert kw["speculative"] is False


def test_generate_hints_at_chat_when_a_chat_model_ends_at_once(fake: FakeEngine) -> None:
    """An empty reply (end of text first) from a model with a chat template, prompted raw: one hint line."""
    def empty(call: int) -> Iterator[Chunk]:
        fake.last_stats = Stats(n_prompt=3)
        yield Chunk("", [], [], "eos")

    fake._reply = empty  # type: ignore[method-assign]
    fake.target = SimpleNamespace(path="fake.gguf", metadata=lambda key: "{{ messages }}")
    result = runner.invoke(cli.app, ["generate", "-p", "Write a story."])
    assert result.exit_code == 0, result.output
    assert _lines(result.stderr)[-1] == "the model ended its reply at once: a chat model may need --chat (its template)"
    assert "--chat" not in runner.invoke(cli.app, ["generate", "--chat", "-p", "Write a story."]).stderr


def test_generate_ctrl_c_stops_the_reply(fake: FakeEngine) -> None:
    fake.interrupt_calls = (0,)
    result = runner.invoke(cli.app, ["generate", "-p", "hi"])
    assert result.exit_code == 130
    assert result.stdout == "Hello\n"
    assert "[interrupted]" in result.stderr and "Traceback" not in result.output


def test_chat_repl(fake: FakeEngine) -> None:
    fake.interrupt_calls = (1,)  # Ctrl-C during the second reply
    script = "first\n/stats\nsecond\nthird\n/bogus\n/help\n/reset\nfourth\n/quit\nnever read\n"
    result = runner.invoke(cli.app, ["chat", "--system", "Be brief."], input=script)
    assert result.exit_code == 0, result.output
    assert len(fake.calls) == 4
    system = {"role": "system", "content": "Be brief."}
    full = "Hello there, friend."
    # The interrupted second reply stays in the history as far as it got.
    assert fake.calls[2][0] == [system, {"role": "user", "content": "first"}, {"role": "assistant", "content": full},
                                {"role": "user", "content": "second"}, {"role": "assistant", "content": "Hello"},
                                {"role": "user", "content": "third"}]
    assert fake.calls[3][0] == [system, {"role": "user", "content": "fourth"}]  # after /reset
    assert fake.resets == 1
    assert fake.calls[0][1]["temperature"] == 0.7 and fake.calls[0][1]["max_tokens"] == 512
    err = result.stderr
    assert err.count("[interrupted]") == 1
    assert "session (2 messages): 5 tokens" in err
    assert "error: unknown command /bogus" in err and "/reset" in err
    assert "never read" not in str(fake.calls)


@pytest.mark.parametrize("exc", [EOFError, KeyboardInterrupt])
def test_chat_exits_cleanly_at_the_prompt(fake: FakeEngine, monkeypatch: pytest.MonkeyPatch,
                                          exc: type[BaseException]) -> None:
    def prompt(label: str = "you") -> str:
        raise exc

    monkeypatch.setattr(cli.ui, "prompt", prompt)
    result = runner.invoke(cli.app, ["chat"])
    assert result.exit_code == 0 and "Traceback" not in result.output
    assert fake.closed and fake.calls == []


def test_demo_compares_with_plain(fake: FakeEngine) -> None:
    result = runner.invoke(cli.app, ["demo"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "Hello there, friend.\n"
    [line] = [ln for ln in _lines(result.stderr) if "speedup" in ln]
    assert re.search(r"5 tokens · spec \d+\.\d tok/s · τ 1\.00 · acceptance 50% · plain \d+\.\d tok/s · "
                     r"speedup \d+\.\d\d× · output identical to plain", line)
    speculative = [kw.get("speculative") for _, kw in fake.calls]
    assert speculative == [True, True, False]  # warm-up, the streamed run, the plain baseline
    assert fake.calls[1][0][0]["content"] == cli.DEMO_PROMPT


def test_demo_needs_a_drafter(fake: FakeEngine) -> None:
    result = runner.invoke(cli.app, ["demo", "--drafter", "none"])
    assert result.exit_code == 1 and _lines(result.stderr)[0].startswith("error: demo compares")


# -- the real default model -------------------------------------------------------------------------


@pytest.mark.real
def test_generate_on_the_real_default_model(smollm2_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from edgespec.cli.app import main; main()", "generate",
         "-p", "The capital of France is", "--max-tokens", "16", "--threads", "2"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    # notes: a model without a cached profile says its first reply learns its costs (#48), and is timed
    # after the reply (or, priced before, the one-time timing of older profiles' missing parts)
    lines = _lines(proc.stderr)
    [line] = [n for n in lines if STATS_LINE.match(n)]
    assert all(n.startswith(("timing ", "checking which verification", "no cost profile")) for n in lines
               if n != line), lines
    assert re.match(r"^(\d+) tokens", line) and int(line.split()[0]) <= 16
    assert "τ" in line  # the default ngram drafter makes it a speculative run (plain while learning: τ 1)


def test_verbose_schedule_line_reports_wasted_verify_positions() -> None:
    from edgespec.cli.ui import format_schedule

    s = Stats(n_tokens=5, t_verify=1.0)
    for d, n in [(3, 1), (2, 2)]:  # 2 rejected positions verified (the 2nd and 3rd of the first cycle)
        s.record_cycle(d, n)
    assert "wasted verify 0.40/token" in format_schedule(s)  # 2 / 5
