"""edgespec.gguf_file on tiny hand-built GGUFs: metadata and tensors as gguf.GGUFReader reads them, and
the one-line diagnosis of cut files (the texts load errors quote)."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from edgespec.gguf_file import add_fields, gguf_problem, read_gguf

HEADER_CUT = "truncated: the file ends inside its GGUF header ({} bytes)"


def write_tiny(path: Path) -> Path:
    """A llama-arch GGUF with scalar, string and array metadata and F32 / F16 / Q8_0 / I64 tensors."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_bool("llama.flag", True)
    w.add_token_list([f"tok{i}" for i in range(50)])
    w.add_key_value("llama.target_layers", [1, 2, 3], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
    w.add_tensor("a.weight", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("b.weight", rng.standard_normal((4, 32)).astype(np.float16))
    q = rng.standard_normal((2, 64)).astype(np.float32)
    w.add_tensor("c.weight", gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("d2t", np.arange(7, dtype=np.int64), raw_dtype=gguf.GGMLQuantizationType.I64)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_tiny(tmp_path / "tiny.gguf")


def cut(src: Path, dst: Path, n: int) -> Path:
    dst.write_bytes(src.read_bytes()[:n])
    return dst


def test_reads_what_gguf_reader_reads(tiny: Path) -> None:
    f = read_gguf(tiny)
    ref = gguf.GGUFReader(tiny)
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            value = f.value(key)
            assert value == pytest.approx(field.contents()) if isinstance(value, float) else value == field.contents()
            assert f.kv[key][1] == field.types[0]
    assert f.kv["llama.target_layers"][2] == gguf.GGUFValueType.INT32
    for t in ref.tensors:
        qtype, shape, _raw = f.tensors[t.name]
        assert qtype == t.tensor_type and shape == tuple(int(d) for d in reversed(t.shape))
        raw = np.asarray(t.data)
        want = raw if t.name == "d2t" else gguf.quants.dequantize(raw, t.tensor_type).reshape(shape)
        np.testing.assert_array_equal(f.tensor(t.name), want)
    assert f.tensor("d2t").dtype == np.int64


def test_keep_key_and_accessors(tiny: Path) -> None:
    f = read_gguf(tiny, lambda k: k.startswith("llama."), with_tensors=False)
    assert f.tensors == {} and f.value("tokenizer.ggml.tokens") is None
    assert "general.alignment" not in f.kv or f.value("general.alignment") == 32
    assert read_gguf(tiny).value("general.architecture") == "llama"
    f = read_gguf(tiny, with_tensors=False)
    assert f.arch_value("block_count") == 2 and f.arch_value("feed_forward_length", 7) == 7
    assert f.require("tokenizer.ggml.tokens")[:2] == ["tok0", "tok1"]
    with pytest.raises(ValueError, match=f"^{tiny} lacks llama.feed_forward_length$"):
        f.arch_value("feed_forward_length")
    with pytest.raises(ValueError, match="lacks general.name"):
        f.require("general.name")


def test_add_fields_copies_metadata(tiny: Path, tmp_path: Path) -> None:
    src = read_gguf(tiny, with_tensors=False)
    w = gguf.GGUFWriter(tmp_path / "copy.gguf", "llama")
    add_fields(w, {k: v for k, v in src.kv.items() if k != "general.architecture"})
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    assert read_gguf(tmp_path / "copy.gguf").kv == src.kv


def tensor_ends(path: Path) -> dict[str, int]:
    """Where each tensor's data ends, by the reference reader."""
    return {t.name: int(t.data_offset) + int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}


def test_intact_file_has_no_problem(tiny: Path) -> None:
    assert gguf_problem(tiny) is None


def test_cut_in_tensor_data(tiny: Path, tmp_path: Path) -> None:
    ends = tensor_ends(tiny)
    need = max(ends.values())
    first = min(ends, key=ends.__getitem__)
    n = ends[first] - 1  # one byte short of the first tensor's end: every tensor is cut
    path = cut(tiny, tmp_path / "cut.gguf", n)
    msg = f"truncated: {n} bytes, but its tensors need {need} (tensor {first} is the first cut off)"
    assert gguf_problem(path) == msg
    with pytest.raises(ValueError) as info:
        read_gguf(path)
    assert str(info.value) == f"{path}: {msg}"
    assert read_gguf(path, with_tensors=False).value("llama.block_count") == 2  # the header is whole
    last = max(ends, key=ends.__getitem__)
    n = need - 1  # only the last tensor is cut
    assert gguf_problem(cut(tiny, path, n)) == (
        f"truncated: {n} bytes, but its tensors need {need} (tensor {last} is the first cut off)")


def test_cut_in_header(tiny: Path, tmp_path: Path) -> None:
    data_start = min(int(t.data_offset) for t in gguf.GGUFReader(tiny).tensors)
    header_end = data_start - 1
    while header_end > 0 and tiny.read_bytes()[header_end - 1] == 0:  # before the alignment padding
        header_end -= 1
    for n in (0, 3, 4, 20, 24, 100, header_end // 2, header_end - 1):
        path = cut(tiny, tmp_path / f"cut{n}.gguf", n)
        assert gguf_problem(path) == HEADER_CUT.format(n), n
        if n >= 4:
            with pytest.raises(ValueError) as info:
                read_gguf(path, with_tensors=False)
            assert str(info.value) == f"{path}: {HEADER_CUT.format(n)}"


def test_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(100))
    assert gguf_problem(path) == "not a GGUF file (starts with b'NOPE', expected b'GGUF')"
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(path)


def with_tensor_type(src: Path, dst: Path, name: str, type_id: int) -> Path:
    """A copy of ``src`` whose tensor ``name`` claims ggml type ``type_id`` (as a newer file would)."""
    data = bytearray(src.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    pos = data.index(key) + len(key)
    (n_dims,) = struct.unpack_from("<I", data, pos)
    struct.pack_into("<I", data, pos + 4 + 8 * n_dims, type_id)
    dst.write_bytes(bytes(data))
    return dst


def test_tensor_types_newer_than_gguf(tiny: Path, tmp_path: Path) -> None:
    """Diagnosis skips a type the gguf package cannot size; reading its tensors refuses it."""
    ends = tensor_ends(tiny)
    last = max(ends, key=ends.__getitem__)
    newer = with_tensor_type(tiny, tmp_path / "newer.gguf", last, 250)
    assert gguf_problem(newer) is None
    assert gguf_problem(cut(newer, tmp_path / "cut.gguf", max(ends.values()) - 1)) is None  # only it is cut
    with pytest.raises(ValueError, match=f"tensor {last} has ggml type 250"):
        read_gguf(newer)
    assert read_gguf(newer, with_tensors=False).value("llama.block_count") == 2


def test_corrupt_value_type(tiny: Path, tmp_path: Path) -> None:
    data = bytearray(tiny.read_bytes())
    key = b"llama.block_count"
    struct.pack_into("<I", data, data.index(key) + len(key), 99)  # no such GGUF value type
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(data))
    assert gguf_problem(path).startswith("corrupt GGUF header (KeyError: 99")
    with pytest.raises(ValueError, match="corrupt GGUF header"):
        read_gguf(path)
