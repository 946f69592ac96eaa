"""`edgespec convert --to mlx MODEL.gguf OUT_DIR`: a GGUF file as an MLX model directory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from edgespec.errors import EdgespecError

_TARGETS = ("mlx",)


def convert(
    model: Annotated[str, typer.Argument(help="GGUF file or known model name (llama or gemma3 architecture).")],
    out_dir: Annotated[Path, typer.Argument(help="Directory to write (config.json, model.safetensors, "
                                                 "tokenizer.gguf).")],
    to: Annotated[str, typer.Option("--to", help="Output format: 'mlx' (an mlx-lm model directory).")] = "mlx",
    bits: Annotated[int, typer.Option(
        "--bits", help="Width (4 or 8) for quantized types MLX cannot hold as they are (Q6_K, Q5_K, ...); "
                       "Q4_0/Q4_1/Q8_0/Q4_K stay as they are, F32/F16 stay float.")] = 8,
) -> None:
    """Convert a GGUF model for another runtime (--to mlx).

    Quantized weights stay quantized where MLX can hold them.
    """
    from edgespec.cli import ui

    if to not in _TARGETS:
        raise EdgespecError(f"--to must be one of {', '.join(_TARGETS)} (got {to!r})")
    from edgespec.backends.deps import import_mlx
    from edgespec.backends.mlx_convert import convert_gguf
    from edgespec.models import resolve_model

    import_mlx()
    convert_gguf(resolve_model(model), out_dir, bits=bits, note=ui.status)
