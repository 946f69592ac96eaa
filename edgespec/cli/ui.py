"""Everything the CLI prints. The only module that imports `rich`.

Generated text goes to stdout unstyled (so `edgespec generate ... > out.txt` captures just the
text); status, stats and errors go to stderr.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from edgespec.stats import Stats

_SEP = " · "


def _stderr() -> Console:
    # Built per call: CliRunner swaps sys.stderr between invocations, and a Console keeps its file.
    return Console(file=sys.stderr, highlight=False, soft_wrap=True)


def write_text(text: str) -> None:
    """Stream generated text to stdout as it arrives."""
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


def end_text() -> None:
    """Finish the streamed text with a newline (before stderr lines follow)."""
    sys.stdout.write("\n")
    sys.stdout.flush()


def status(message: str) -> None:
    """A dim progress/status line on stderr."""
    _stderr().print(f"[dim]{escape(message)}[/dim]")


def print_error(message: object) -> None:
    """`error: <message>` in red on stderr, always one line."""
    line = " ".join(str(message).split()) or type(message).__name__
    _stderr().print(f"[bold red]error:[/bold red] [red]{escape(line)}[/red]")


def format_stats(stats: Stats, *, speculative: bool | None = None) -> str:
    """One line: tokens, decode tok/s, and for speculative runs τ and acceptance rate.

    `speculative` None: show τ and acceptance when anything was drafted.
    """
    parts = [f"{stats.n_tokens} tokens", f"{stats.tok_per_s:.1f} tok/s"]
    if speculative or (speculative is None and stats.n_drafted):
        acceptance = f"{stats.acceptance_rate:.0%}" if stats.n_drafted else "– (nothing drafted)"
        parts += [f"τ {stats.tau:.2f}", f"acceptance {acceptance}"]
        if stats.tree_cycles:  # a tree's drafts are its nodes: most are alternatives, rejected by design
            parts.append(f"{stats.n_drafted / stats.n_cycles:.1f} tree nodes/cycle")
    return _SEP.join(parts)


def format_schedule(stats: Stats) -> str:
    """The scheduler's line: γ histogram, share of time in plain steps, rejected draft positions
    verified per token, predicted vs measured speed, and what its decisions cost."""
    hist = " ".join(f"{g}:{n}" for g, n in stats.gamma_histogram.items())
    parts = [f"γ histogram {hist or '–'}",
             f"plain steps {stats.t_plain / stats.t_decode:.0%} of decode time" if stats.t_decode else "no decode",
             f"wasted verify {stats.wasted_per_token:.2f}/token"]
    if stats.n_planned:
        parts += [f"predicted {stats.predicted_tok_per_s:.1f} tok/s vs measured {stats.tok_per_s:.1f}",
                  f"decision {stats.t_schedule / stats.n_planned * 1e6:.0f} µs/cycle"]
        if stats.n_probes:
            parts.append(f"{stats.n_probes} probe(s)")
        if stats.by_member:
            parts.append("drafts from " + ", ".join(f"{m} {n}" for m, n in stats.by_member.most_common()))
    return _SEP.join(parts)


def print_stats(stats: Stats, *, speculative: bool | None = None, prefix: str = "", verbose: bool = False) -> None:
    """The stats line on stderr, e.g. `120 tokens · 210.4 tok/s · τ 2.31 · acceptance 52%`; with
    `verbose`, the scheduler's line under it."""
    line = (f"{prefix}: " if prefix else "") + format_stats(stats, speculative=speculative)
    _stderr().print(f"[cyan]{escape(line)}[/cyan]")
    if verbose and (speculative or stats.n_planned):
        _stderr().print(f"[dim cyan]{escape(format_schedule(stats))}[/dim cyan]")


def format_comparison(spec: Stats, plain: Stats, *, identical: bool | None = None,
                      ratios: Sequence[float] = ()) -> str:
    """One line comparing a speculative run with plain decoding of the same prompt. With `ratios`
    (pairwise spec/plain speed ratios of alternating repeats) the speedup is their median and range."""
    speedup = spec.tok_per_s / plain.tok_per_s if plain.tok_per_s > 0 else 0.0
    parts = [f"{spec.n_tokens} tokens", f"spec {spec.tok_per_s:.1f} tok/s", f"τ {spec.tau:.2f}",
             f"acceptance {spec.acceptance_rate:.0%}", f"plain {plain.tok_per_s:.1f} tok/s",
             f"speedup {speedup:.2f}×"]
    if len(ratios) > 1:
        r = sorted(ratios)
        parts[-1] = f"speedup {r[len(r) // 2]:.2f}× (median of {len(r)} alternating pairs, {r[0]:.2f}–{r[-1]:.2f})"
    if identical is not None:
        parts.append("output identical to plain" if identical else "output DIFFERS from plain")
    return _SEP.join(parts)


def print_comparison(spec: Stats, plain: Stats, *, identical: bool | None = None,
                     ratios: Sequence[float] = ()) -> None:
    line = format_comparison(spec, plain, identical=identical, ratios=ratios)
    _stderr().print(f"[bold cyan]{escape(line)}[/bold cyan]")


def interrupted() -> None:
    """Mark a reply that Ctrl-C cut short."""
    _stderr().print("[yellow]\\[interrupted][/yellow]")


def prompt(label: str = "you") -> str:
    """Read one line of user input (raises EOFError on Ctrl-D, KeyboardInterrupt on Ctrl-C)."""
    console = _stderr()
    console.print(f"[bold green]{escape(label)}>[/bold green] ", end="")
    return input()


def assistant_label(label: str = "assistant") -> None:
    _stderr().print(f"[bold magenta]{escape(label)}>[/bold magenta] ", end="")


def print_help(lines: Iterable[tuple[str, str]]) -> None:
    """Two-column help (command, what it does) on stderr."""
    console = _stderr()
    for cmd, text in lines:
        console.print(f"  [bold]{escape(cmd)}[/bold]  {escape(text)}")


def print_table(columns: Sequence[str], rows: Iterable[Sequence[object]], *, title: str | None = None) -> None:
    """A table on stdout (e.g. `edgespec models list`)."""
    table = Table(title=title, header_style="bold")
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*(escape(str(v)) for v in row))
    Console(file=sys.stdout).print(table)


@contextmanager
def progress(description: str, total: int) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr; yields `advance_to(completed)`."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=_stderr(), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda done: bar.update(task, completed=done)
