"""`edgespec convert --to mlx MODEL.gguf OUT_DIR`: a GGUF file as an MLX model directory;
`edgespec convert --head HEAD_DIR --target TARGET --out head.gguf`: a published EAGLE-3, DFlash or
Medusa checkpoint as a head GGUF (edgespec.heads.convert)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from edgespec.errors import EdgespecError

_TARGETS = ("mlx",)


def convert(
    model: Annotated[str | None, typer.Argument(
        help="GGUF file or known model name (llama or gemma3 architecture), for --to mlx.")] = None,
    out_dir: Annotated[Path | None, typer.Argument(help="Directory to write (config.json, model.safetensors, "
                                                        "tokenizer.gguf), for --to mlx.")] = None,
    to: Annotated[str, typer.Option("--to", help="Output format: 'mlx' (an mlx-lm model directory).")] = "mlx",
    bits: Annotated[int, typer.Option(
        "--bits", help="Width (4 or 8) for quantized types MLX cannot hold as they are (Q6_K, Q5_K, ...); "
                       "Q4_0/Q4_1/Q8_0/Q4_K stay as they are, F32/F16 stay float.")] = 8,
    head: Annotated[Path | None, typer.Option(
        "--head", help="A published EAGLE-3 (EAGLE, SpecForge, speculators), DFlash v1 or Medusa (FasterDecoding) checkpoint directory "
                       "(config.json + safetensors) to convert into a head GGUF.")] = None,
    target: Annotated[str | None, typer.Option(
        "--target", help="With --head: the target GGUF or known model name the head drafts for.")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="With --head: the head GGUF to write.")] = None,
    outtype: Annotated[str, typer.Option("--outtype", help="With --head: f16, q8_0 or f32 matrices.")] = "f16",
) -> None:
    """Convert a GGUF to MLX, or a published head to GGUF.

    --to mlx MODEL OUT_DIR: quantized weights stay quantized where MLX can hold them.
    --head HEAD_DIR --target TARGET --out head.gguf: an EAGLE-3 or DFlash checkpoint, checked against
    the target (hidden size, vocabulary, layer ids, tensors) and written in llama.cpp's layout; a Medusa
    checkpoint as a `medusa` GGUF (its heads draft on llama.cpp: --drafter head.gguf).
    """
    from edgespec.cli import ui

    if head is not None:
        if target is None or out is None or model is not None:
            raise EdgespecError("convert --head HEAD_DIR needs --target TARGET and --out FILE.gguf "
                                "(and no MODEL/OUT_DIR arguments)")
        from edgespec.heads.convert import convert_head
        from edgespec.models import resolve_model

        convert_head(head, resolve_model(target), out, outtype=outtype, note=ui.status)
        return
    if model is None or out_dir is None:
        raise EdgespecError("convert needs MODEL OUT_DIR (--to mlx) or --head HEAD_DIR --target TARGET --out FILE")
    if to not in _TARGETS:
        raise EdgespecError(f"--to must be one of {', '.join(_TARGETS)} (got {to!r})")
    from edgespec.backends.deps import import_mlx
    from edgespec.backends.mlx_convert import convert_gguf
    from edgespec.models import resolve_model

    import_mlx()
    convert_gguf(resolve_model(model), out_dir, bits=bits, note=ui.status)
