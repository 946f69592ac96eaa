"""The one GGUF reader: metadata, tensor infos and memory-mapped tensor data, and why a file is broken.

The header is walked with ``struct`` and tensor data mapped with numpy: ``gguf.GGUFReader`` builds a
Python object per vocabulary entry, which every target and head file carries (opening SmolLM2 or
Gemma-3 that way takes ~30× as long as this walk). Tensors are dequantized with
``gguf.quants.dequantize``. The same walk diagnoses a cut file (``gguf_problem``), tolerating
tensor types newer than the ``gguf`` package (their extent is unknown, so they are skipped).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_SIZE = {t: struct.calcsize(fmt) for t, fmt in _SCALAR.items()}
_STRING, _ARRAY = 8, 9
_QUANT_SIZES = {int(t): size for t, size in gguf.GGML_QUANT_SIZES.items()}  # ggml type id → (block, bytes)

Field = tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]  # (value, type, array sub-type)


class _HeaderCut(Exception):
    """The file ends inside its header."""


@dataclass
class GGUFFile:
    """A GGUF file's metadata and tensors, with the data memory-mapped (valid while open)."""

    path: Path
    kv: dict[str, Field]  # key → (value, type, sub-type)
    tensors: dict[str, tuple[gguf.GGMLQuantizationType, tuple[int, ...], npt.NDArray[np.uint8]]] = field(
        default_factory=dict)  # name → (type, numpy shape = reversed ne, raw bytes)

    def value(self, key: str, default: Any = None) -> Any:
        """The value of ``key``, or ``default`` if the file lacks it (or it was not kept)."""
        return self.kv[key][0] if key in self.kv else default

    def require(self, key: str, default: Any = None) -> Any:
        """The value of ``key``, else ``default``; ValueError naming the file and key if both are absent."""
        v = self.value(key, default)
        if v is None:
            raise ValueError(f"{self.path} lacks {key}")
        return v

    def arch_value(self, key: str, default: Any = None) -> Any:
        """``require`` of ``<general.architecture>.<key>`` (e.g. "embedding_length")."""
        return self.require(f"{self.value('general.architecture')}.{key}", default)

    def tensor(self, name: str) -> npt.NDArray[Any]:
        """Tensor ``name`` as float32 (dequantized), or int64/int32 for integer tensors."""
        qtype, shape, raw = self.tensors[name]
        if qtype in (gguf.GGMLQuantizationType.I64, gguf.GGMLQuantizationType.I32):
            return raw.view(np.int64 if qtype == gguf.GGMLQuantizationType.I64 else np.int32).reshape(shape).copy()
        rows = raw.reshape(-1, raw.size // max(1, int(np.prod(shape[:-1])))) if len(shape) > 1 else raw[None]
        return np.asarray(gguf.quants.dequantize(rows, qtype), np.float32).reshape(shape).copy()


def _walk(mm: mmap.mmap, keep_key: Callable[[str], bool]) -> tuple[dict[str, Field], list[tuple], int]:
    """Header of a GGUF mapping: kept metadata, tensor infos (name, ggml type id, numpy shape, offset)
    and where the data starts. Raises _HeaderCut if the file ends inside the header."""
    pos = 24

    def value(vtype: int, keep: bool) -> Any:
        nonlocal pos
        if vtype == _STRING:
            (n,) = struct.unpack_from("<Q", mm, pos)
            pos += 8 + n
            return mm[pos - n:pos].decode("utf-8", "replace") if keep else None
        if vtype == _ARRAY:
            sub, n = struct.unpack_from("<IQ", mm, pos)
            pos += 12
            if sub != _STRING and not keep:
                pos += n * _SIZE[sub]
                return None
            return [value(sub, keep) for _ in range(n)]
        (v,) = struct.unpack_from(_SCALAR[vtype], mm, pos)
        pos += _SIZE[vtype]
        return v

    try:
        n_tensors, n_kv = struct.unpack_from("<QQ", mm, 8)
        kv: dict[str, Field] = {}
        for _ in range(n_kv):
            (n,) = struct.unpack_from("<Q", mm, pos)
            key = mm[pos + 8:pos + 8 + n].decode("utf-8", "replace")
            (vtype,) = struct.unpack_from("<I", mm, pos + 8 + n)
            pos += 12 + n
            sub = struct.unpack_from("<I", mm, pos)[0] if vtype == _ARRAY else None
            keep = keep_key(key) or key == "general.alignment"
            v = value(vtype, keep)
            if keep:
                kv[key] = (v, gguf.GGUFValueType(vtype), gguf.GGUFValueType(sub) if sub is not None else None)
        infos = []
        for _ in range(n_tensors):
            (n,) = struct.unpack_from("<Q", mm, pos)
            name = mm[pos + 8:pos + 8 + n].decode("utf-8", "replace")
            pos += 8 + n
            (n_dims,) = struct.unpack_from("<I", mm, pos)
            ne = struct.unpack_from(f"<{n_dims}Q", mm, pos + 4)
            qtype, offset = struct.unpack_from("<IQ", mm, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, qtype, tuple(reversed(ne)), offset))
    except struct.error as e:  # a read past the end of the mapping
        raise _HeaderCut from e
    if pos > len(mm):
        raise _HeaderCut
    align = kv.get("general.alignment", (32,))[0]
    return kv, infos, -(-pos // align) * align


def _nbytes(qtype: int, shape: tuple[int, ...]) -> int:
    block, type_size = _QUANT_SIZES[qtype]
    return int(np.prod(shape)) // block * type_size


def _cut_tensors(infos: list[tuple], data_start: int, size: int) -> str | None:
    """The truncation message if a tensor of known type lies past ``size`` bytes, else None."""
    ends = [(data_start + offset + _nbytes(qtype, shape), name)
            for name, qtype, shape, offset in infos if qtype in _QUANT_SIZES]
    cut = [(end, name) for end, name in ends if end > size]
    if not cut:
        return None
    return f"truncated: {size} bytes, but its tensors need {max(cut)[0]} (tensor {min(cut)[1]} is the first cut off)"


def _header_cut(size: int) -> str:
    return f"truncated: the file ends inside its GGUF header ({size} bytes)"


def read_gguf(path: str | Path, keep_key: Callable[[str], bool] = lambda k: True,
              with_tensors: bool = True) -> GGUFFile:
    """Read a GGUF file.

    Args:
        path: the file.
        keep_key: which metadata keys to decode (others are skipped; general.alignment is always kept).
        with_tensors: also map the tensors (infos and raw bytes; ``GGUFFile.tensor`` dequantizes).

    Returns:
        The GGUFFile. Raises ValueError on a non-GGUF, corrupt or truncated file, or (with tensors)
        one holding a tensor type the ``gguf`` package does not know.
    """
    path = Path(path)
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        kv, infos, data_start = _walk(mm, keep_key)
    except _HeaderCut:
        raise ValueError(f"{path}: {_header_cut(len(mm))}") from None
    except (KeyError, ValueError) as e:  # an unknown value type
        raise ValueError(f"{path}: corrupt GGUF header ({type(e).__name__}: {e})") from None
    out = GGUFFile(path, kv)
    if with_tensors:
        for name, qtype, _shape, _offset in infos:
            if qtype not in _QUANT_SIZES:
                raise ValueError(f"{path}: tensor {name} has ggml type {qtype}, unknown to the gguf package")
        problem = _cut_tensors(infos, data_start, len(mm))
        if problem:
            raise ValueError(f"{path}: {problem}")
        buf = np.frombuffer(mm, np.uint8)
        for name, qtype, shape, offset in infos:
            start = data_start + offset
            out.tensors[name] = (gguf.GGMLQuantizationType(qtype), shape, buf[start:start + _nbytes(qtype, shape)])
    return out


def gguf_problem(path: str | Path) -> str | None:
    """Why a GGUF file cannot load, read from its header alone: "truncated: ..." (the file ends inside
    its header, or a tensor lies past its end), "not a GGUF file ..." or "corrupt GGUF header (...)";
    None if the header and the file size agree. Tensors of types newer than the gguf package are skipped."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
            if len(magic) < 4:
                return _header_cut(len(magic))
            if magic != b"GGUF":
                return f"not a GGUF file (starts with {magic!r}, expected b'GGUF')"
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                try:
                    _kv, infos, data_start = _walk(mm, lambda k: False)
                except _HeaderCut:
                    return _header_cut(len(mm))
                return _cut_tensors(infos, data_start, len(mm))
    except (ValueError, KeyError, OSError) as e:
        return f"corrupt GGUF header ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"


def add_fields(w: gguf.GGUFWriter, fields: Mapping[str, Field]) -> None:
    """Add metadata as ``GGUFFile.kv`` holds it (key → (value, type, sub-type)): copies a file's keys."""
    for key, (value, vtype, sub) in fields.items():
        w.add_key_value(key, value, vtype, sub_type=sub)
