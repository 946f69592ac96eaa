"""The `edgespec` command line: generate, chat, demo, models, profile, bench, convert, train-head.

Heavy modules (llama_cpp, the backends) load inside the commands, so `edgespec --help` works
without llama-cpp-python. Every EdgespecError becomes one red `error: ...` line and exit code 1.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from edgespec.cli import bench_cmd, convert_cmd, models_cmd, profile_cmd, serve_cmd, train_cmd, ui
from edgespec.cli.options import RunOptions, run_options
from edgespec.errors import EdgespecError, MissingDependencyError

_LLAMA_HINT = "llama-cpp-python is not installed: pip install 'edgespec[llama]'"


class _Group(TyperGroup):
    """Turns user-facing errors from any command (sub-apps included) into one red line, exit 1.

    ValueError counts as user-facing: the project raises it for bad values it names."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except (EdgespecError, ValueError) as e:  # the project's user-input errors: one line each
            ui.print_error(e)
        except ImportError as e:
            if not (e.name or "").startswith("llama_cpp"):
                raise
            ui.print_error(MissingDependencyError(_LLAMA_HINT))
        raise typer.Exit(1)


app = typer.Typer(
    name="edgespec",
    cls=_Group,
    help="Lossless speculative decoding for local LLMs (llama.cpp, MLX).",
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from edgespec import __version__

        typer.echo(f"edgespec {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Show the version and exit.")] = False,
) -> None:
    """Lossless speculative decoding for local LLMs (llama.cpp, MLX)."""


# -- streaming with Ctrl-C ---------------------------------------------------------------------------


class _CtrlC:
    """While active, the first Ctrl-C asks the engine to stop after its current cycle (the stream then
    ends with finish_reason "cancelled"); a second one raises KeyboardInterrupt."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.hit = False
        self._old: Any = None

    def _handler(self, signum: int, frame: object) -> None:
        if self.hit:
            raise KeyboardInterrupt
        self.hit = True
        self.engine.cancel()

    def __enter__(self) -> _CtrlC:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def stream_to_stdout(engine: Any, chunks: Iterator[Any]) -> tuple[str, str]:
    """Write a stream's text to stdout as it comes. Returns (text, finish_reason).

    Ctrl-C stops the generation (finish_reason "cancelled"); the engine stays usable.
    """
    parts: list[str] = []
    reason = "length"
    with _CtrlC(engine) as ctrl_c:
        try:
            for chunk in chunks:
                ui.write_text(chunk.text)
                parts.append(chunk.text)
                reason = chunk.finish_reason or reason
                if ctrl_c.hit:  # repeat: a cancel that raced the stream's start was cleared by it
                    engine.cancel()
        except KeyboardInterrupt:
            ctrl_c.hit = True
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
    return "".join(parts), ("cancelled" if ctrl_c.hit else reason)


def _read_prompt(prompt: str | None) -> str:
    if prompt is not None and prompt != "-":
        return prompt
    if prompt is None and sys.stdin.isatty():
        raise EdgespecError("no prompt: pass -p TEXT, or pipe the prompt on stdin")
    text = sys.stdin.read()
    text = text[:-1] if text.endswith("\n") else text
    if not text.strip():
        raise EdgespecError("the prompt read from stdin is empty")
    return text


# -- commands --------------------------------------------------------------------------------------


@app.command()
@run_options()
def generate(
    opts: RunOptions,
    prompt: Annotated[str | None, typer.Option(
        "--prompt", "-p", help="Prompt text; '-' or omitted: read stdin.")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the model's chat template.")] = False,
    stop: Annotated[list[str] | None, typer.Option(
        "--stop", help="Stop at this string (repeatable).")] = None,
) -> None:
    """Generate a completion (greedy by default).

    Text streams to stdout, one stats line to stderr.
    """
    opts.check()
    text = _read_prompt(prompt)
    with opts.load() as engine:
        kw = {**opts.sampling(), "stop": tuple(stop or ())}
        chunks = engine.stream_chat([{"role": "user", "content": text}], **kw) if chat else engine.stream(text, **kw)
        _, reason = stream_to_stdout(engine, chunks)
        ui.end_text()
        if reason == "cancelled":
            ui.interrupted()
        if engine.last_stats is not None:
            ui.print_stats(engine.last_stats, speculative=_speculative(engine, opts), verbose=opts.verbose)
            if not engine.last_stats.n_tokens and reason == "eos" and not chat \
                    and engine.target.metadata("tokenizer.chat_template") is not None:
                ui.status("the model ended its reply at once: a chat model may need --chat (its template)")
        _finish_timing(engine)
    if reason == "cancelled":
        raise typer.Exit(130)


def _finish_timing(engine: Any) -> None:
    """After a one-shot reply from a target without a cost profile: let its idle timing finish (the
    reply is out; Ctrl-C skips it), so the next run on this machine can speculate."""
    if engine.timing:
        ui.status("timing the target for the scheduler (once per model, a few seconds; Ctrl-C skips)")
        try:
            engine.wait_priced()
        except KeyboardInterrupt:
            ui.end_text()


_CHAT_HELP = (("/reset", "forget the conversation"), ("/stats", "totals for this session"),
              ("/help", "this list"), ("/quit", "leave (or Ctrl-D)"))


@app.command()
@run_options(temp=0.7, max_tokens=512)
def chat(
    opts: RunOptions,
    system: Annotated[str | None, typer.Option(
        "--system", "-s", help="System message that starts the conversation.")] = None,
) -> None:
    """Chat in the terminal (temperature 0.7 by default).

    Uses the model's chat template. Ctrl-C stops a reply (the partial reply
    stays in the history); Ctrl-C or Ctrl-D at the prompt quits.
    """
    from edgespec.stats import Stats

    with opts.load() as engine:
        ui.status(f"chatting with {engine.target.path} (drafter: {_drafter_name(engine)}); "
                  "/help for commands, Ctrl-D to quit")
        engine.calibrate(background=True)  # an unprofiled target is timed while the user types (stopped by a reply)
        start = [{"role": "system", "content": system}] if system else []
        history, totals = list(start), Stats()
        while True:
            try:
                line = ui.prompt()
            except (EOFError, KeyboardInterrupt):
                ui.end_text()
                return
            cmd = line.strip()
            if not cmd:
                continue
            if cmd in ("/quit", "/exit", "/q"):
                return
            if cmd == "/reset":
                history = list(start)
                engine.reset()
                ui.status("conversation cleared")
                continue
            if cmd == "/stats":
                ui.print_stats(totals, speculative=_speculative(engine, opts), verbose=True,
                               prefix=f"session ({len(history) - len(start)} messages)")
                continue
            if cmd in ("/help", "/?"):
                ui.print_help(_CHAT_HELP)
                continue
            if cmd.startswith("/"):
                ui.print_error(f"unknown command {cmd.split()[0]} (try /help)")
                continue
            history.append({"role": "user", "content": line})
            ui.assistant_label()
            try:
                reply, reason = stream_to_stdout(engine, engine.stream_chat(history, **opts.sampling()))
            except EdgespecError as e:  # e.g. the conversation outgrew --ctx: keep the session
                history.pop()
                ui.end_text()
                ui.print_error(f"{e} (message dropped; /reset starts over)")
                continue
            history.append({"role": "assistant", "content": reply})
            ui.end_text()
            if reason == "cancelled":
                ui.interrupted()
            if engine.last_stats is not None:
                totals = totals.merge(engine.last_stats)
                ui.print_stats(engine.last_stats, speculative=_speculative(engine, opts), verbose=opts.verbose)


# A prompt the n-gram drafter can copy from: the reply repeats the page with one edit. Greedy SmolLM2-135M
# + ngram, γ = 4: τ ≈ 4, acceptance ≈ 80%, about 210 tokens to EOS.
DEMO_PROMPT = """Change the title of this HTML page to "My Garden" and show the full page:

<!DOCTYPE html>
<html>
  <head>
    <meta charset="utf-8">
    <title>My Page</title>
    <link rel="stylesheet" href="style.css">
  </head>
  <body>
    <h1>Welcome</h1>
    <p>This page lists the plants in my garden.</p>
    <ul>
      <li>Tomatoes</li>
      <li>Basil</li>
      <li>Sunflowers</li>
      <li>Strawberries</li>
      <li>Lavender</li>
    </ul>
    <h2>Contact</h2>
    <p>Write to me at <a href="mailto:gardener@example.com">gardener@example.com</a>.</p>
    <footer>
      <p>Last updated in May.</p>
    </footer>
  </body>
</html>
"""


@app.command()
@run_options(max_tokens=256)
def demo(
    opts: RunOptions,
    repeats: Annotated[int, typer.Option(
        "--repeats", "-r", min=1, help="Alternating spec/plain pairs; the line then quotes medians.")] = 1,
) -> None:
    """Compare speculative with plain decoding on a built-in prompt.

    Prints one comparison line. Greedy by default, so both runs must produce
    the same text (the decoding is lossless).
    """
    if opts.no_spec or opts.drafter.lower() == "none":
        raise EdgespecError("demo compares speculative with plain decoding: it needs a drafter "
                            "(drop --no-spec / --drafter none)")
    messages = [{"role": "user", "content": DEMO_PROMPT}]
    with opts.load(learn=False) as engine:  # a comparison needs the costs: priced at load
        ui.status(f"target {engine.target.path} · drafter {_drafter_name(engine)} · γ {opts.num_draft} · "
                  f"{'greedy' if opts.temp == 0 else f'temperature {opts.temp}'}")
        first, *rest = DEMO_PROMPT.strip().splitlines()
        ui.status(f"prompt: {first} [+ {len(rest) - 1} lines of HTML]")
        kw = opts.sampling()
        engine.chat(messages, **{**kw, "max_tokens": 8})  # warm-up: first-call allocations
        text, reason = stream_to_stdout(engine, engine.stream_chat(messages, **kw))
        ui.end_text()
        if reason == "cancelled":
            ui.interrupted()
            raise typer.Exit(130)
        specs, plains = [engine.last_stats], []
        ui.status("plain decoding of the same prompt (speculative=False)"
                  + (f", then {repeats - 1} more alternating pairs" if repeats > 1 else "") + " ...")
        plain = engine.chat(messages, **{**kw, "speculative": False})
        plains.append(plain.stats)
        identical = plain.text == text
        for _ in range(repeats - 1):
            specs.append(engine.chat(messages, **kw).stats)
            plains.append(engine.chat(messages, **{**kw, "speculative": False}).stats)
        mid = len(specs) // 2
        spec = sorted(specs, key=lambda s: s.tok_per_s)[mid]
        plain_stats = sorted(plains, key=lambda s: s.tok_per_s)[mid]
        ratios = [s.tok_per_s / p.tok_per_s for s, p in zip(specs, plains) if p.tok_per_s > 0]
        ui.print_comparison(spec, plain_stats, identical=identical if opts.temp == 0 else None, ratios=ratios)
        if opts.verbose:
            ui.status(ui.format_schedule(spec))


def _speculative(engine: Any, opts: RunOptions) -> bool:
    return engine.drafter is not None and not opts.no_spec


def _drafter_name(engine: Any) -> str:
    return "none" if engine.drafter is None else engine.drafter.name


# Registered after generate, chat and demo so that `edgespec --help` lists those first.
app.command()(serve_cmd.serve)
app.command()(profile_cmd.profile)
app.command()(bench_cmd.bench)
app.command()(convert_cmd.convert)
app.command("train-head")(train_cmd.train_head)
app.add_typer(models_cmd.app)


def main() -> None:
    """Console-script entry point (`edgespec`)."""
    app(prog_name="edgespec")


if __name__ == "__main__":
    main()
