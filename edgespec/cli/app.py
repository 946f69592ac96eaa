"""The `edgespec` command line: generate, chat, demo, models.

Heavy modules (llama_cpp, the backends) load inside the commands, so `edgespec --help` works
without llama-cpp-python. Every EdgespecError becomes one red `error: ...` line and exit code 1.
"""

from __future__ import annotations

import functools
import inspect
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace
from typing import Annotated, Any, Optional

import click
import typer
from typer.core import TyperGroup

from edgespec.cli import models_cmd, ui
from edgespec.errors import EdgespecError, MissingDependencyError

_LLAMA_HINT = "llama-cpp-python is not installed: pip install 'edgespec[llama]' (or make install)"


class _Group(TyperGroup):
    """Turns user-facing errors from any command (sub-apps included) into one red line, exit 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except EdgespecError as e:
            ui.print_error(e)
        except ImportError as e:
            if not (e.name or "").startswith("llama_cpp"):
                raise
            ui.print_error(MissingDependencyError(_LLAMA_HINT))
        raise typer.Exit(1)


app = typer.Typer(
    name="edgespec",
    cls=_Group,
    help="Lossless speculative decoding for local LLMs (llama.cpp).",
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(models_cmd.app)


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
    """Lossless speculative decoding for local LLMs (llama.cpp)."""


# -- options shared by generate / chat / demo ------------------------------------------------------


@dataclass(frozen=True)
class RunOptions:
    """The model, drafter and sampling flags every generating command takes."""

    target: Optional[str] = None  # noqa: UP045 (typer reads these types at run time)
    drafter: str = "ngram"
    num_draft: int = 4
    temp: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: Optional[int] = None  # noqa: UP045
    max_tokens: int = 256
    threads: Optional[int] = None  # noqa: UP045
    ctx: int = 4096
    gpu_layers: int = 0
    no_spec: bool = False
    verbose: bool = False

    def check(self) -> None:
        """Reject bad values before any model is loaded."""
        from edgespec.sampling import SamplingParams

        SamplingParams(self.temp, self.top_k, self.top_p, self.min_p)
        for flag, value, low in (("--num-draft", self.num_draft, 0), ("--max-tokens", self.max_tokens, 1),
                                 ("--ctx", self.ctx, 16), ("--threads", self.threads, 1)):
            if value is not None and value < low:
                raise EdgespecError(f"{flag} must be >= {low} (got {value})")

    def load(self):
        """The Engine for these options (no drafter with --no-spec or --drafter none)."""
        import edgespec

        self.check()
        drafter = None if self.no_spec or self.drafter.lower() == "none" else self.drafter
        return edgespec.load(self.target, drafter, n_ctx=self.ctx, threads=self.threads,
                             n_gpu_layers=self.gpu_layers, num_draft=self.num_draft, verbose=self.verbose)

    def sampling(self) -> dict[str, Any]:
        """Keyword arguments for Engine.stream / stream_chat."""
        return dict(max_tokens=self.max_tokens, temperature=self.temp, top_k=self.top_k, top_p=self.top_p,
                    min_p=self.min_p, seed=self.seed, num_draft=self.num_draft, speculative=not self.no_spec)


_PANEL = "Model and sampling"
_FLAGS: dict[str, tuple[tuple[str, ...], str]] = {
    "target": (("--target",), "Target model: GGUF path or known name (default: smollm2; see `edgespec models list`)."),
    "drafter": (("--drafter",), "Drafter: 'ngram' (prompt lookup), a same-vocabulary GGUF path or model name, "
                                "or 'none'."),
    "num_draft": (("--num-draft", "-k"), "γ: draft tokens per cycle."),
    "temp": (("--temp",), "Temperature (0 = greedy)."),
    "top_k": (("--top-k",), "Keep the k most likely tokens (0 = off)."),
    "top_p": (("--top-p",), "Nucleus sampling mass in (0, 1] (1 = off)."),
    "min_p": (("--min-p",), "Drop tokens below min_p × the top probability (0 = off)."),
    "seed": (("--seed",), "Sampler seed (default: random)."),
    "max_tokens": (("--max-tokens", "-n"), "Most tokens to generate."),
    "threads": (("--threads",), "CPU threads (default: up to 8)."),
    "ctx": (("--ctx",), "Context size in tokens."),
    "gpu_layers": (("--gpu-layers",), "Layers to offload on GPU builds of llama.cpp (-1 = all)."),
    "no_spec": (("--no-spec",), "Decode plainly (no drafter): the baseline."),
    "verbose": (("--verbose",), "Show llama.cpp's own log."),
}


def run_options(**defaults: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add the RunOptions flags to a command; the command receives them as `opts: RunOptions`.

    `defaults` override RunOptions' defaults for this command (e.g. temp=0.7 for chat).
    """
    base = replace(RunOptions(), **defaults)

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        own = [p for p in inspect.signature(func, eval_str=True).parameters.values() if p.name != "opts"]
        shared = []
        for f in fields(RunOptions):
            flags, help_text = _FLAGS[f.name]
            option = typer.Option(*flags, help=help_text, rich_help_panel=_PANEL)
            annotation = Annotated[_runtime_type(f.type), option]
            shared.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                                            default=getattr(base, f.name), annotation=annotation))

        @functools.wraps(func)
        def command(**kwargs: Any) -> Any:
            opts = RunOptions(**{f.name: kwargs.pop(f.name) for f in fields(RunOptions)})
            return func(opts, **kwargs)

        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + shared
        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        del command.__wrapped__  # typer must read the signature above, not func's
        return command

    return decorate


def _runtime_type(annotation: object) -> object:
    """RunOptions' field types are strings under `from __future__ import annotations`."""
    names = {"Optional[str]": Optional[str], "Optional[int]": Optional[int],  # noqa: UP045
             "str": str, "int": int, "float": float, "bool": bool}
    return names[annotation] if isinstance(annotation, str) else annotation


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
    prompt: Annotated[Optional[str], typer.Option(  # noqa: UP045
        "--prompt", "-p", help="Prompt text; '-' or omitted: read stdin.")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt in the model's chat template.")] = False,
    stop: Annotated[Optional[list[str]], typer.Option(  # noqa: UP045
        "--stop", help="Stop at this string (repeatable).")] = None,
) -> None:
    """Generate a completion: text streams to stdout, one stats line to stderr (greedy by default)."""
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
            ui.print_stats(engine.last_stats)
    if reason == "cancelled":
        raise typer.Exit(130)


_CHAT_HELP = (("/reset", "forget the conversation"), ("/stats", "totals for this session"),
              ("/help", "this list"), ("/quit", "leave (or Ctrl-D)"))


@app.command()
@run_options(temp=0.7, max_tokens=512)
def chat(
    opts: RunOptions,
    system: Annotated[Optional[str], typer.Option(  # noqa: UP045
        "--system", "-s", help="System message that starts the conversation.")] = None,
) -> None:
    """Chat in the terminal with the model's chat template (temperature 0.7 by default).

    Ctrl-C stops a reply (the partial reply stays in the history); Ctrl-C or Ctrl-D at the prompt quits.
    """
    from edgespec.stats import Stats

    opts.check()
    with opts.load() as engine:
        ui.status(f"chatting with {engine.target.path} (drafter: {_drafter_name(engine)}); "
                  "/help for commands, Ctrl-D to quit")
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
                ui.print_stats(totals, prefix=f"session ({len(history) - len(start)} messages)")
                continue
            if cmd in ("/help", "/?"):
                ui.print_help(_CHAT_HELP)
                continue
            if cmd.startswith("/"):
                ui.print_error(f"unknown command {cmd.split()[0]} (try /help)")
                continue
            history.append({"role": "user", "content": line})
            ui.assistant_label()
            reply, reason = stream_to_stdout(engine, engine.stream_chat(history, **opts.sampling()))
            history.append({"role": "assistant", "content": reply})
            ui.end_text()
            if reason == "cancelled":
                ui.interrupted()
            if engine.last_stats is not None:
                totals = totals.merge(engine.last_stats)
                ui.print_stats(engine.last_stats)


# A prompt the n-gram drafter can copy from: the reply repeats most of the code it was given.
DEMO_PROMPT = """Rewrite this Python function with a docstring. Keep the code the same.

def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            averages.append(total / window)
    return averages
"""


@app.command()
@run_options(max_tokens=200)
def demo(opts: RunOptions) -> None:
    """Speculative vs plain decoding on a built-in prompt; prints one comparison line.

    Greedy by default, so both runs must produce the same text (the decoding is lossless).
    """
    if opts.no_spec or opts.drafter.lower() == "none":
        raise EdgespecError("demo compares speculative with plain decoding: it needs a drafter "
                            "(drop --no-spec / --drafter none)")
    opts.check()
    messages = [{"role": "user", "content": DEMO_PROMPT}]
    with opts.load() as engine:
        ui.status(f"target {engine.target.path} · drafter {_drafter_name(engine)} · γ {opts.num_draft} · "
                  f"{'greedy' if opts.temp == 0 else f'temperature {opts.temp}'}")
        ui.status("prompt: " + DEMO_PROMPT.splitlines()[0] + " [a 12-line function]")
        kw = opts.sampling()
        engine.chat(messages, **{**kw, "max_tokens": 8})  # warm-up: first-call allocations
        text, reason = stream_to_stdout(engine, engine.stream_chat(messages, **kw))
        ui.end_text()
        if reason == "cancelled":
            ui.interrupted()
            raise typer.Exit(130)
        spec = engine.last_stats
        ui.status("plain decoding of the same prompt (speculative=False) ...")
        plain = engine.chat(messages, **{**kw, "speculative": False})
        ui.print_comparison(spec, plain.stats, identical=(plain.text == text) if opts.temp == 0 else None)


def _drafter_name(engine: Any) -> str:
    return getattr(engine.drafter, "name", None) or ("none" if engine.drafter is None else "?")


def main() -> None:
    """Console-script entry point (`edgespec`)."""
    app(prog_name="edgespec")


if __name__ == "__main__":
    main()
