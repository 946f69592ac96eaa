"""Tiny mlx-lm model directories for tests (config.json + model.safetensors), built in milliseconds.

Weights are seeded numpy draws, so a target and a perturbed copy make a same-vocabulary drafter pair.
The directories carry no tokenizer: tests hand MlxBackend a vocabulary object (`vocab=`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

LM_HEAD_GAIN = 1.5  # next-token logits ~ N(0, 1.5²): peaked, yet several tokens keep real mass

_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # layers 0 and 2 slide (window 4), layer 1 is global; embeddings are scaled by √H before layer 0
    "gemma3_text": dict(hidden_size=32, num_hidden_layers=3, intermediate_size=64, num_attention_heads=2,
                        head_dim=16, num_key_value_heads=1, sliding_window=4, sliding_window_pattern=2,
                        query_pre_attn_scalar=16, rms_norm_eps=1e-6),
    # recurrent (ArraysCache state, restored from a checkpoint): Mamba, Mamba-2
    "mamba": dict(hidden_size=16, intermediate_size=32, state_size=4, num_hidden_layers=1, conv_kernel=4,
                  use_bias=False, use_conv_bias=True, time_step_rank=4, tie_word_embeddings=True),
    "mamba2": dict(num_heads=4, head_dim=8, hidden_size=16, intermediate_size=32, state_size=8,
                   num_hidden_layers=2, layer_norm_epsilon=1e-5, conv_kernel=4, n_groups=1, use_bias=False,
                   use_conv_bias=True, tie_word_embeddings=False, time_step_limit=[0.0, 100.0], time_step_rank=4),
    # hybrids: LFM2 (short-conv layers 0, 2 beside attention layers 1, 3); Falcon-H1 (each layer:
    # Mamba-2 state + KV in a CacheList)
    "lfm2": dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=512, norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=32,
                 block_ff_dim=64, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
                 block_auto_adjust_ff_dim=False, full_attn_idxs=[1, 3]),
    "falcon_h1": dict(hidden_size=32, head_dim=8, intermediate_size=64, mamba_d_head=8, mamba_d_ssm=32,
                      mamba_d_state=8, mamba_n_heads=4, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2),
    # still refused: a sliding-window RotatingKVCache inside a CacheList (layer 0 slides)
    "baichuan_m1": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, rope_theta=10000.0, sliding_window=4, sliding_window_layers=[0],
                        conv_window=2, rms_norm_eps=1e-5),
}


def build_tiny_mlx(out: str | Path, *, n_vocab: int = 6, model_type: str = "llama", seed: int = 0,
                   perturb: float = 0.0, base_seed: int | None = None, n_layers: int | None = None) -> Path:
    """Write a random-weight mlx-lm model directory.

    Args:
        out: directory to create.
        n_vocab: vocabulary size (6: small enough to enumerate every sampled path).
        model_type: a key of _CONFIGS: "llama", "gemma3_text"; recurrent "mamba", "mamba2"; hybrid
            "lfm2", "falcon_h1"; "baichuan_m1" (still refused).
        seed: weight seed; with perturb > 0 it seeds the noise added to base_seed's weights.
        perturb: noise scale relative to each tensor's init (a drafter of tunable quality).
        base_seed: the seed of the model being perturbed (default seed).
        n_layers: num_hidden_layers instead of the architecture's default.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    config = {"model_type": model_type, "vocab_size": n_vocab, **_CONFIGS[model_type]}
    if n_layers is not None:
        config["num_hidden_layers"] = n_layers
    model_class, args_class = _get_classes(config)
    shapes = {k: v.shape for k, v in tree_flatten(model_class(args_class.from_dict(config)).parameters())}

    def draw(rng: np.random.Generator) -> dict[str, np.ndarray]:
        out = {}
        for name, shape in sorted(shapes.items()):
            std = (shape[-1] ** -0.5) * (LM_HEAD_GAIN if name.startswith("lm_head") else 1.0)
            out[name] = (rng.standard_normal(shape) * std).astype(np.float32)
            if len(shape) == 1 and "norm" in name:
                out[name] = np.ones(shape, np.float32)
        return out

    weights = draw(np.random.default_rng(seed if perturb == 0 else (base_seed if base_seed is not None else seed)))
    if perturb > 0:
        noise = draw(np.random.default_rng([seed, 0x5EED]))
        weights = {k: v + np.float32(perturb) * noise[k] if "norm" not in k else v for k, v in weights.items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


@pytest.fixture(scope="module")
def own_mlx_home(tmp_path_factory: pytest.TempPathFactory):
    """Converted models are cached under $EDGESPEC_HOME/mlx: keep a test module's out of the user's.
    Modules that convert GGUFs import it and mark themselves ``usefixtures("own_mlx_home")``."""
    mp = pytest.MonkeyPatch()
    mp.setenv("EDGESPEC_HOME", str(tmp_path_factory.mktemp("home")))
    yield
    mp.undo()
