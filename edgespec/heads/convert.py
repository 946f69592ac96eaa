"""Published head checkpoints → head GGUFs: ``edgespec convert --head`` and ``--drafter HEAD_DIR``.

A checkpoint directory's config.json decides the converter: EAGLE-3 (``heads.convert_eagle3``:
the EAGLE repo's traineagle3 layout, SpecForge's LlamaForCausalLMEagle3, vLLM speculators'
Eagle3Speculator), DFlash v1 (``heads.convert_dflash``: z-lab's DFlashDraftModel) or Medusa
(``heads.convert_medusa``: FasterDecoding's medusa_lm_head). The result is the same GGUF edgespec's
own heads use (``heads.gguf_io`` / ``heads.dflash_gguf``: llama.cpp's eagle3 / dflash layouts;
``heads.medusa``: edgespec's medusa layout), with the target's vocabulary, so every head runner reads it.

``cached_head`` converts a directory once per content: the key hashes config.json and every weight
file (sha256, remembered per file size and mtime in ``$EDGESPEC_HOME/heads/hashes.json``), the
target (``models.model_key``), the weight type and ``CONVERTER_VERSION``; the GGUF lands in
``$EDGESPEC_HOME/heads``, as MLX conversions land in ``$EDGESPEC_HOME/mlx``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edgespec.heads.convert_dflash import dflash_layout
from edgespec.heads.convert_eagle3 import ARCHITECTURES as EAGLE3_ARCHITECTURES
from edgespec.heads.convert_eagle3 import eagle3_layout
from edgespec.heads.convert_medusa import medusa_layout
from edgespec.heads.hf_checkpoint import CheckpointError, read_checkpoint, read_target

CONVERTER_VERSION = 1  # part of the cache key: bump when the output changes
OUTTYPES = ("f16", "q8_0", "f32")
KNOWN = (f"EAGLE-3 ({', '.join(EAGLE3_ARCHITECTURES)}, or EAGLE's LlamaForCausalLM with draft_vocab_size), "
         "DFlash v1 (DFlashDraftModel) and Medusa (medusa_lm_head.safetensors)")
NAMES = {"eagle3": "EAGLE-3", "dflash": "DFlash", "medusa": "Medusa"}
Note = Callable[[str], None]


def head_layout(config: dict[str, Any]) -> tuple[str, str] | None:
    """("eagle3" | "dflash" | "medusa", layout name) for a head checkpoint's config.json, None if it
    names no head; CheckpointError for a head family edgespec refuses (DFlash2, DSpark)."""
    layout = eagle3_layout(config)
    if layout is not None:
        return "eagle3", layout
    layout = dflash_layout(config)
    if layout is not None:
        return "dflash", layout
    layout = medusa_layout(config)
    return None if layout is None else ("medusa", layout)


def is_head_checkpoint(spec: str | os.PathLike[str]) -> bool:
    """Whether ``spec`` is a directory whose config.json names a head architecture (refused ones
    included, so that converting them says why). Reads config.json only."""
    p = Path(spec).expanduser()
    try:
        config = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        return False
    try:
        kind = head_layout(config) if isinstance(config, dict) else None
        return kind is not None
    except CheckpointError:
        return True


def convert_head(head_dir: str | os.PathLike, target: str | os.PathLike, out: str | os.PathLike, *,
                 outtype: str = "f16", note: Note | None = None) -> Path:
    """Convert a published head checkpoint into a head GGUF for ``target``.

    Args:
        head_dir: the checkpoint directory (config.json + safetensors).
        target: the target GGUF (a path: names are resolved by the caller); its header is checked and its
            vocabulary copied.
        out: the GGUF to write (replaced atomically).
        outtype: "f16" (default), "q8_0" or "f32" for the matrices (norms stay F32; a DFlash fc F32).
        note: called with progress lines.

    Returns:
        ``out`` as a Path.

    Raises:
        CheckpointError: one line naming what does not fit (see the per-layout converters).
    """
    say = note or (lambda _line: None)
    if outtype not in OUTTYPES:
        raise CheckpointError(f"--outtype must be one of {', '.join(OUTTYPES)} (got {outtype!r})")
    ckpt = read_checkpoint(head_dir)
    kind = head_layout(ckpt.config)
    if kind is None:
        raise CheckpointError(f"{ckpt.path}: unknown head layout (architectures {ckpt.config.get('architectures')}); "
                              f"edgespec converts {KNOWN}")
    tgt = read_target(Path(target).expanduser())
    arch, layout = kind
    extra = {"edgespec.head.source": str(ckpt.path), "edgespec.head.layout": layout,
             "edgespec.head.converter_version": str(CONVERTER_VERSION)}
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        if arch == "eagle3":
            from edgespec.heads.convert_eagle3 import convert_eagle3
            from edgespec.heads.gguf_io import write_eagle3_gguf

            e3, tensors = convert_eagle3(ckpt, layout, tgt, say)
            write_eagle3_gguf(tmp, e3, tensors, vocab_source=tgt.path, weight_type=outtype,
                              name=f"{ckpt.path.name} ({layout} EAGLE-3)", extra_kv=extra)
        elif arch == "medusa":
            from edgespec.heads.convert_medusa import convert_medusa
            from edgespec.heads.medusa import write_medusa_gguf

            md, tensors = convert_medusa(ckpt, tgt, say)
            base = ckpt.config.get("base_model_name_or_path")
            write_medusa_gguf(tmp, md, tensors, vocab_source=tgt.path, weight_type=outtype,
                              name=f"{ckpt.path.name} ({layout} heads)",
                              extra_kv=extra | ({"edgespec.head.base_model": str(base)} if base else {}))
        else:
            from edgespec.heads.convert_dflash import convert_dflash
            from edgespec.heads.dflash_gguf import write_dflash_gguf

            df, tensors = convert_dflash(ckpt, tgt, say)
            write_dflash_gguf(tmp, df, tensors, vocab_source=tgt.path, weight_type=outtype,
                              name=f"{ckpt.path.name} ({layout})", extra_kv=extra)
        os.replace(tmp, out)
    except ValueError as e:  # a hyperparameter the head config refuses (attention shape, block size, ...)
        raise CheckpointError(f"cannot convert {ckpt.path}: {e}") from None
    finally:
        tmp.unlink(missing_ok=True)
    say(f"wrote {out}: {NAMES[arch]} head ({layout} layout) for {tgt.path.name}, "
        f"{outtype}")
    return out


def cached_head(head_dir: str | os.PathLike, target: str | os.PathLike, *, outtype: str = "f16",
                note: Note | None = None) -> Path:
    """The head GGUF of a checkpoint directory for ``target`` under $EDGESPEC_HOME/heads, converting
    it the first time (announced through ``note``)."""
    from edgespec.models import edgespec_home, model_key

    ckpt = read_checkpoint(head_dir)
    tgt = Path(target).expanduser()
    home = edgespec_home() / "heads"
    h = hashlib.sha256(f"v{CONVERTER_VERSION}:{outtype}:{model_key(tgt)}".encode())
    for f in ckpt.files:
        h.update(f"{f.name}:{_file_sha256(f, home)}".encode())
    final = home / f"{ckpt.path.name}-{h.hexdigest()[:16]}.gguf"
    if final.is_file():
        return final
    home.mkdir(parents=True, exist_ok=True)
    (note or (lambda _line: None))(f"converting the head {ckpt.path} to GGUF once (cached in {final})")
    return convert_head(ckpt.path, tgt, final, outtype=outtype, note=note)


def _file_sha256(path: Path, home: Path) -> str:
    """sha256 of a file, remembered in home/hashes.json per resolved path, size and mtime."""
    st, key = path.stat(), str(path.resolve())
    memo_file = home / "hashes.json"
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    entry = memo.get(key) if isinstance(memo, dict) else None
    if isinstance(entry, dict) and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
        return str(entry["sha256"])
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    memo = memo if isinstance(memo, dict) else {}
    memo[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": h.hexdigest()}
    home.mkdir(parents=True, exist_ok=True)
    tmp = memo_file.with_name(f".hashes.json.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(memo, indent=1) + "\n")
    os.replace(tmp, memo_file)
    return h.hexdigest()

