"""Tiny recurrent and hybrid GGUFs for tests (random weights, `gguf.GGUFWriter`, built in seconds).

* ``build_tiny_mamba2``: a pure recurrent Mamba-2 (llama.cpp arch ``mamba2``: conv + SSM state).
* ``build_tiny_lfm2``: an LFM2 hybrid (``lfm2``: short-convolution layers beside attention layers).

Tensor and key names are llama.cpp's (src/llama-arch.cpp), shapes those of src/models/mamba2.cpp and
lfm2.cpp; the tokenizer is copied from a real GGUF as in gguf_fixtures, so text prompts work, and the
same ``vocab_source`` gives the same vocabulary: a target and a perturbed copy make a drafter pair.
``recurrent_ggufs`` (a session fixture) builds both pairs once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt
import pytest
from gguf_fixtures import OUTPUT_STD, add_tokenizer, random_weights, vocab_size

# The drafter copies: the target + 0.05 × init std × noise; greedy agreement with the target on 64
# tokens: mamba2 0.81, lfm2 0.70 (0.02: 0.92 / 0.86, 0.1: 0.70 / 0.48, 0.2: 0.36 / 0.23).
DRAFT_PERTURB = 0.05
ARCHS = ("mamba2", "lfm2")


def _write(path: Path, arch: str, name: str, vocab_source: Path, hparams: Callable[[gguf.GGUFWriter], None],
           weights: dict[str, npt.NDArray[np.float32]]) -> Path:
    w = gguf.GGUFWriter(path, arch)
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(vocab_size(vocab_source))
    hparams(w)
    add_tokenizer(w, vocab_source)
    for tensor, value in weights.items():
        w.add_tensor(tensor, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def build_tiny_mamba2(path: str | Path, *, vocab_source: Path, n_layer: int = 2, n_embd: int = 64,
                      d_inner: int = 128, d_state: int = 16, n_head: int = 4, n_group: int = 1, d_conv: int = 4,
                      seed: int = 0, perturb: float = 0.0, base_seed: int | None = None) -> Path:
    """Write a random-weight Mamba-2 GGUF (all f32) with ``vocab_source``'s tokenizer.

    Args:
        path: where to write the file.
        vocab_source: a real GGUF whose ``tokenizer.*`` metadata is copied.
        n_layer, n_embd: blocks and residual width.
        d_inner, d_state, n_head, n_group, d_conv: the SSM's inner width, state size, heads
            (``ssm.time_step_rank``), B/C groups and causal-conv kernel width.
        seed, perturb, base_seed: as for gguf_fixtures.build_tiny_llama (perturb > 0: the weights of
            ``base_seed`` moved by ``perturb`` × init std × noise; token_embd, A, D, dt bias and the
            norms are shared).

    Returns:
        ``path`` as a Path. Recurrent state per layer: (d_conv-1)·(d_inner + 2·n_group·d_state) conv
        values + d_state·d_inner SSM values, f32.
    """
    if d_inner % n_head or d_inner % n_group or n_head % n_group:
        raise ValueError(f"d_inner {d_inner} / n_head {n_head} / n_group {n_group} do not divide")
    n_vocab = vocab_size(vocab_source)
    conv_dim = d_inner + 2 * n_group * d_state
    specs = [("token_embd.weight", (n_vocab, n_embd), 1.0)]
    for i in range(n_layer):
        b = f"blk.{i}."
        specs += [
            (b + "attn_norm.weight", (n_embd,), 0.0),
            (b + "ssm_in.weight", (d_inner + conv_dim + n_head, n_embd), n_embd**-0.5),  # z, xBC, dt
            (b + "ssm_conv1d.weight", (conv_dim, d_conv), d_conv**-0.5),
            (b + "ssm_conv1d.bias", (conv_dim,), 0.1),
            (b + "ssm_norm.weight", (n_group, d_inner // n_group), 0.0),
            (b + "ssm_out.weight", (n_embd, d_inner), d_inner**-0.5),
        ]
    specs += [("output_norm.weight", (n_embd,), 0.0), ("output.weight", (n_vocab, n_embd), OUTPUT_STD)]
    weights = random_weights(specs, seed=seed, perturb=perturb, base_seed=base_seed)
    # Mamba-2's own init, shared by drafter copies: A = -(1..16), dt = softplus(dt_bias) in [0.01, 0.3]
    dt = np.exp(np.linspace(np.log(0.01), np.log(0.3), n_head))
    for i in range(n_layer):
        b = f"blk.{i}."
        weights[b + "ssm_a"] = -np.linspace(1.0, 16.0, n_head, dtype=np.float32).reshape(n_head, 1)
        weights[b + "ssm_d"] = np.ones((n_head, 1), np.float32)
        weights[b + "ssm_dt.bias"] = np.log(np.expm1(dt)).astype(np.float32)

    def hparams(w: gguf.GGUFWriter) -> None:
        w.add_context_length(2048)
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(0)
        w.add_head_count(0)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_ssm_conv_kernel(d_conv)
        w.add_ssm_inner_size(d_inner)
        w.add_ssm_state_size(d_state)
        w.add_ssm_time_step_rank(n_head)
        w.add_ssm_group_count(n_group)

    return _write(Path(path), "mamba2", f"edgespec tiny mamba2 (seed {seed}, perturb {perturb}, base {base_seed})",
                  vocab_source, hparams, weights)


def build_tiny_lfm2(path: str | Path, *, vocab_source: Path, layers: str = "caca", n_embd: int = 64,
                    n_head: int = 2, n_head_kv: int = 1, n_ff: int = 128, l_cache: int = 3, seed: int = 0,
                    perturb: float = 0.0, base_seed: int | None = None) -> Path:
    """Write a random-weight LFM2 hybrid GGUF (all f32) with ``vocab_source``'s tokenizer.

    Args:
        path: where to write the file.
        vocab_source: a real GGUF whose ``tokenizer.*`` metadata is copied.
        layers: one letter per block: "c" a short-convolution layer (recurrent: its last
            ``l_cache - 1`` inputs), "a" an attention layer (KV cache; head_count_kv 0 marks the others).
        n_embd, n_head, n_head_kv, n_ff: widths (head size n_embd / n_head: 32 lets llama.cpp keep
            a Q8_0 KV cache).
        l_cache: the convolution's kernel width (``shortconv.l_cache``).
        seed, perturb, base_seed: as for gguf_fixtures.build_tiny_llama.

    Returns:
        ``path`` as a Path. Recurrent state per conv layer: (l_cache-1)·n_embd f32 values.
    """
    if set(layers) - {"a", "c"} or "c" not in layers:
        raise ValueError(f"layers must be a string of 'a' and 'c' with at least one 'c' (got {layers!r})")
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError(f"n_embd {n_embd} / n_head {n_head} / n_head_kv {n_head_kv} do not divide")
    n_vocab, hd = vocab_size(vocab_source), n_embd // n_head
    specs = [("token_embd.weight", (n_vocab, n_embd), 1.0)]
    for i, kind in enumerate(layers):
        b = f"blk.{i}."
        specs += [(b + "attn_norm.weight", (n_embd,), 0.0)]
        if kind == "a":
            specs += [
                (b + "attn_q.weight", (n_embd, n_embd), n_embd**-0.5),
                (b + "attn_k.weight", (n_head_kv * hd, n_embd), n_embd**-0.5),
                (b + "attn_v.weight", (n_head_kv * hd, n_embd), n_embd**-0.5),
                (b + "attn_q_norm.weight", (hd,), 0.0),
                (b + "attn_k_norm.weight", (hd,), 0.0),
                (b + "attn_output.weight", (n_embd, n_embd), n_embd**-0.5),
            ]
        else:
            specs += [
                (b + "shortconv.in_proj.weight", (3 * n_embd, n_embd), n_embd**-0.5),  # B, C, x
                (b + "shortconv.conv.weight", (n_embd, l_cache), l_cache**-0.5),
                (b + "shortconv.out_proj.weight", (n_embd, n_embd), n_embd**-0.5),
            ]
        specs += [
            (b + "ffn_norm.weight", (n_embd,), 0.0),
            (b + "ffn_gate.weight", (n_ff, n_embd), n_embd**-0.5),
            (b + "ffn_up.weight", (n_ff, n_embd), n_embd**-0.5),
            (b + "ffn_down.weight", (n_embd, n_ff), n_ff**-0.5),
        ]
    # llama.cpp reads LFM2's final norm as token_embd_norm (LLM_TENSOR_OUTPUT_NORM_LFM2)
    specs += [("token_embd_norm.weight", (n_embd,), 0.0), ("output.weight", (n_vocab, n_embd), OUTPUT_STD)]
    weights = random_weights(specs, seed=seed, perturb=perturb, base_seed=base_seed)

    def hparams(w: gguf.GGUFWriter) -> None:
        w.add_context_length(2048)
        w.add_embedding_length(n_embd)
        w.add_block_count(len(layers))
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv([n_head_kv if kind == "a" else 0 for kind in layers])
        w.add_layer_norm_rms_eps(1e-5)
        w.add_rope_freq_base(1_000_000.0)
        w.add_shortconv_l_cache(l_cache)

    return _write(Path(path), "lfm2", f"edgespec tiny lfm2 (seed {seed}, perturb {perturb}, base {base_seed})",
                  vocab_source, hparams, weights)


BUILDERS = {"mamba2": build_tiny_mamba2, "lfm2": build_tiny_lfm2}


def build_pair(arch: str, root: Path, vocab_source: Path, perturb: float = DRAFT_PERTURB) -> tuple[Path, Path]:
    """A target (seed 0) and its drafter (seed 1, the target's weights + ``perturb`` × noise) of
    ``arch`` ("mamba2" or "lfm2"), written under ``root``."""
    build = BUILDERS[arch]
    target = build(root / f"tiny_{arch}.gguf", vocab_source=vocab_source, seed=0)
    draft = build(root / f"tiny_{arch}_draft.gguf", vocab_source=vocab_source, seed=1, base_seed=0, perturb=perturb)
    return target, draft


@pytest.fixture(scope="session")
def recurrent_ggufs(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> dict[str, tuple[Path, Path]]:
    """arch → (target, drafter) GGUF paths for every arch in ARCHS, with SmolLM2's tokenizer."""
    root = tmp_path_factory.mktemp("recurrent")
    return {arch: build_pair(arch, root, smollm2_path) for arch in ARCHS}
