"""Tiny GGUF files for tests, built in seconds with `gguf.GGUFWriter` (no download).

`build_tiny_llama` writes a random-weight llama-arch model whose tokenizer is copied from a real
GGUF, so llama.cpp loads, tokenizes and decodes with it. Same `vocab_source` → same vocabulary:
a target and a perturbed copy of it make a drafter pair with tunable acceptance.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

from edgespec.gguf_file import add_fields, read_gguf

TOKENIZER_PREFIX = "tokenizer."


@functools.lru_cache(maxsize=4)
def _tokenizer_fields(vocab_source: Path) -> tuple[tuple[str, Any, gguf.GGUFValueType, Any], ...]:
    """Every ``tokenizer.*`` key of ``vocab_source`` as (key, value, type, array sub-type)."""
    kv = _read_kv(vocab_source, None)
    out = [
        (key, tuple(v) if isinstance(v, list) else v, vtype, sub)
        for key, (v, vtype, sub) in kv.items()
        if key.startswith(TOKENIZER_PREFIX)
    ]
    if "tokenizer.ggml.tokens" not in kv:
        raise ValueError(f"{vocab_source} has no tokenizer.ggml.tokens: not a usable vocab source")
    return tuple(out)


# Measured on 64 random tokens (llama.cpp 0.3.36): with a tied LM head a random llama mostly predicts
# its input token again (<E_tok, E_tok> dominates; 92% of positions) and greedy decoding locks into
# one repeated token; a separate output.weight ~ N(0, 0.5²) gives entropy 4.2 nats, top-1 prob 0.26,
# and greedy runs of 40 tokens without a repeat. So the LM head is untied unless asked.
OUTPUT_STD = 0.5


def _tensor_specs(n_vocab, n_layer, n_embd, n_head, n_head_kv, n_ff, tied_output, layer_scale=1.0):
    """(name, numpy shape, init std) in a fixed order; numpy shape = reversed GGUF ne; std 0 = ones."""
    head_dim = n_embd // n_head
    s = layer_scale
    specs = [("token_embd.weight", (n_vocab, n_embd), 1.0)]
    for i in range(n_layer):
        b = f"blk.{i}."
        specs += [
            (b + "attn_norm.weight", (n_embd,), 0.0),
            (b + "attn_q.weight", (n_head * head_dim, n_embd), n_embd**-0.5),
            (b + "attn_k.weight", (n_head_kv * head_dim, n_embd), n_embd**-0.5),
            (b + "attn_v.weight", (n_head_kv * head_dim, n_embd), n_embd**-0.5),
            (b + "attn_output.weight", (n_embd, n_head * head_dim), s * (n_head * head_dim) ** -0.5),
            (b + "ffn_norm.weight", (n_embd,), 0.0),
            (b + "ffn_gate.weight", (n_ff, n_embd), n_embd**-0.5),
            (b + "ffn_up.weight", (n_ff, n_embd), n_embd**-0.5),
            (b + "ffn_down.weight", (n_embd, n_ff), s * n_ff**-0.5),
        ]
    specs.append(("output_norm.weight", (n_embd,), 0.0))
    if not tied_output:
        specs.append(("output.weight", (n_vocab, n_embd), OUTPUT_STD))
    return specs


def _weights(specs, seed: int) -> dict[str, npt.NDArray[np.float32]]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape, std in specs:
        if std == 0.0:
            out[name] = np.ones(shape, dtype=np.float32)
        else:
            out[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    return out


def random_weights(specs, *, seed: int, perturb: float = 0.0, base_seed: int | None = None
                   ) -> dict[str, npt.NDArray[np.float32]]:
    """Weights for (name, numpy shape, init std) specs (std 0: ones): N(0, std²) from ``seed``; with
    ``perturb > 0``, those of ``base_seed`` (default ``seed``) plus ``perturb`` × std × noise seeded
    by ``seed``, token_embd and the ones kept (a drafter sharing the target's embeddings)."""
    if perturb <= 0:
        return _weights(specs, seed)
    weights = _weights(specs, seed if base_seed is None else base_seed)
    noise_rng = np.random.default_rng([seed, 0x5EED])
    for name, shape, std in specs:
        if std != 0.0 and name != "token_embd.weight":
            noise = noise_rng.standard_normal(shape, dtype=np.float32) * np.float32(perturb * std)
            weights[name] = weights[name] + noise
    return weights


def vocab_size(vocab_source: Path) -> int:
    """Number of tokens in ``vocab_source``'s vocabulary."""
    return next(len(v) for k, v, *_ in _tokenizer_fields(Path(vocab_source)) if k == "tokenizer.ggml.tokens")


def add_tokenizer(w: gguf.GGUFWriter, vocab_source: Path, chat_template: str | None = None) -> None:
    """Copy every ``tokenizer.*`` field of ``vocab_source`` into ``w`` (``chat_template``, if given,
    replaces the template)."""
    for key, value, vtype, sub_type in _tokenizer_fields(Path(vocab_source)):
        if key == "tokenizer.chat_template" and chat_template is not None:
            continue
        w.add_key_value(key, list(value) if isinstance(value, tuple) else value, vtype, sub_type)
    if chat_template is not None:
        w.add_key_value("tokenizer.chat_template", chat_template, gguf.GGUFValueType.STRING)


def build_tiny_llama(
    path: str | Path,
    *,
    vocab_source: Path,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    seed: int = 0,
    perturb: float = 0.0,
    base_seed: int | None = None,
    chat_template: str | None = None,
    context_length: int = 2048,
    tied_output: bool = False,
    layer_scale: float = 1.0,
) -> Path:
    """Write a random-weight llama GGUF (all f32) with ``vocab_source``'s tokenizer.

    Args:
        path: where to write the file.
        vocab_source: a real GGUF whose ``tokenizer.*`` metadata (vocab, merges, special ids,
            chat template) is copied.
        n_layer, n_embd, n_head, n_head_kv, n_ff: llama hyperparameters.
        seed: weight seed; with ``perturb > 0`` it seeds the noise instead.
        perturb: if > 0, the weights of ``base_seed`` plus ``perturb`` × noise scaled like each
            tensor's init; token_embd and the norms are shared. Measured against the base on 64
            positions: perturb 0.05 / 0.1 / 0.2 / 0.3 → greedy agreement 0.80 / 0.64 / 0.38 / 0.22,
            sum(min(p, q)) at temperature 1 0.87 / 0.74 / 0.51 / 0.34; an unrelated seed: 0.00 / 0.01.
        base_seed: seed of the model being perturbed (default ``seed``).
        chat_template: replaces ``tokenizer.chat_template`` (e.g. a malicious template).
        context_length: ``llama.context_length``.
        tied_output: no ``output.weight`` (LM head = token_embd). Such random models mostly repeat
            their input token, so greedy decoding with them is degenerate; use only to test tying.
        layer_scale: scales the init std of attn_output and ffn_down, i.e. how much each layer adds
            to the residual stream (small: the next token depends mostly on the current one, which
            a hand-fitted EAGLE-3 head can learn; see tests/eagle_fixtures.py).

    Returns:
        ``path`` as a Path.
    """
    path = Path(path)
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError(f"n_embd {n_embd} / n_head {n_head} / n_head_kv {n_head_kv} do not divide")
    n_vocab = vocab_size(vocab_source)
    specs = _tensor_specs(n_vocab, n_layer, n_embd, n_head, n_head_kv, n_ff, tied_output, layer_scale)
    weights = random_weights(specs, seed=seed, perturb=perturb, base_seed=base_seed)

    w = gguf.GGUFWriter(path, "llama")
    w.add_name(f"edgespec tiny llama (seed {seed}, perturb {perturb}, base {base_seed})")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_context_length(context_length)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(n_vocab)
    add_tokenizer(w, vocab_source, chat_template)
    for name, _shape, _std in specs:
        w.add_tensor(name, weights[name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def truncate_file(src: str | Path, dst: str | Path, keep_fraction: float) -> Path:
    """Copy the first ``keep_fraction`` of ``src``'s bytes to ``dst`` (a truncated-download fixture)."""
    if not 0.0 <= keep_fraction < 1.0:
        raise ValueError(f"keep_fraction must be in [0, 1), got {keep_fraction}")
    data = Path(src).read_bytes()
    dst = Path(dst)
    dst.write_bytes(data[: int(len(data) * keep_fraction)])
    return dst


def write_not_gguf(path: str | Path, size: int = 4096, seed: int = 0) -> Path:
    """Write ``size`` random bytes that do not start with the GGUF magic."""
    data = bytearray(np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes())
    data[:4] = b"NOPE"
    path = Path(path)
    path.write_bytes(bytes(data))
    return path


def read_gguf_kv(path: str | Path, keys: set[str] | None = None) -> dict[str, Any]:
    """Metadata of a GGUF file, without parsing its tensors: ``gguf.GGUFReader`` takes 3.5 s on
    SmolLM2 and 15 s on Gemma (it parses every vocabulary entry); this takes 0.1-0.4 s.
    ``keys`` limits what is decoded."""
    return {k: v for k, (v, _t, _s) in _read_kv(Path(path), keys).items()}


def _read_kv(path: Path, keys: set[str] | None) -> dict[str, tuple[Any, gguf.GGUFValueType, Any]]:
    """key → (value, type, array sub-type or None): edgespec's own header reader, no tensors."""
    return read_gguf(path, (lambda k: True) if keys is None else keys.__contains__, with_tensors=False).kv


def dequantize_gguf(src: str | Path, dst: str | Path) -> Path:
    """A copy of `src` with every tensor dequantized to F32 (same metadata): the very weights of a
    quantized model, evaluated by llama.cpp without its quantized kernels (which round activations
    to 8 bits) — the reference for cross-backend parity."""
    f = read_gguf(src)
    writer = gguf.GGUFWriter(dst, f.value("general.architecture"))
    add_fields(writer, {k: v for k, v in f.kv.items() if k not in ("general.architecture", "general.file_type")})
    for name in f.tensors:
        writer.add_tensor(name, f.tensor(name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)
