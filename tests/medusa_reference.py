"""An independent torch (float64) port of the Medusa heads' forward, and checkpoints in the published layout.

Written from the upstream code, not from edgespec's heads (FasterDecoding/Medusa at e2a5d20):
- ``medusa/model/medusa_model.py``: ``ResBlock`` is ``x + SiLU(linear(x))`` with ``linear = nn.Linear(H, H)``
  (bias on, weight initialised to zero); ``MedusaModel.medusa_head`` is an ``nn.ModuleList`` of
  ``nn.Sequential(*([ResBlock(H)] * medusa_num_layers), nn.Linear(H, V, bias=False))`` (one ResBlock module
  repeated: its layers share their weights), applied to ``outputs[0]`` of the base ``model`` (the decoder's
  output after its final norm); ``from_pretrained`` loads the ModuleList's state dict;
- ``medusa/model/medusa_model_legacy.py`` since 2b8020f (config ``version: "2"``): the Sequential stops at the
  ResBlocks and the logits are ``base_model.lm_head(medusa_head[i](hidden_states))``;
- ``medusa/train/train_legacy.py``: ``save_file(medusa_head.state_dict(), "medusa_lm_head.safetensors")``
  next to the ``MedusaConfig``'s config.json (medusa_num_heads, medusa_num_layers, base_model_name_or_path,
  version).

``untied=True`` builds one ResBlock per layer instead (text-generation-inference's reading of the same keys:
``server/text_generation_server/layers/medusa.py`` at 91560ed, ``MedusaHead``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
WEIGHTS = "medusa_lm_head.safetensors"


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        torch.nn.init.zeros_(self.linear.weight)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


def medusa_heads(n_heads: int, n_layers: int, hidden: int, vocab: int, *, own_output: bool = True,
                 untied: bool = False) -> nn.ModuleList:
    """Upstream's ``medusa_head`` ModuleList (``own_output=False``: the version-2 heads)."""
    def head() -> nn.Sequential:
        blocks = [ResBlock(hidden) for _ in range(n_layers)] if untied else [ResBlock(hidden)] * n_layers
        return nn.Sequential(*blocks, *([nn.Linear(hidden, vocab, bias=False)] if own_output else []))

    return nn.ModuleList([head() for _ in range(n_heads)])


def write_checkpoint(d: Path, n_heads: int, n_layers: int, hidden: int, vocab: int, *,
                     own_output: bool = True, untied: bool = False, dtype: str = "fp32",
                     seed: int = 0) -> Path:
    """A Medusa checkpoint directory as train_legacy.py saves one, with random non-zero weights
    (matrices ~ N(0, 1/fan_in), biases ~ 0.1·N(0, 1)) stored in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    heads = medusa_heads(n_heads, n_layers, hidden, vocab, own_output=own_output, untied=untied)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / (p.shape[1] ** 0.5 if p.ndim == 2 else 10.0))
    # state_dict() names a shared block once per layer; safetensors refuses shared storage, so copy
    state = {k: v.detach().to(DTYPES[dtype]).clone().contiguous() for k, v in heads.state_dict().items()}
    d.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = {"medusa_num_heads": n_heads, "medusa_num_layers": n_layers,
                              "base_model_name_or_path": "tiny/target", "transformers_version": "4.36.2"}
    if not own_output:
        config["version"] = "2"
    (d / "config.json").write_text(json.dumps(config, indent=2))
    from safetensors.torch import save_file

    save_file(state, str(d / WEIGHTS))
    return d


def reference_logits(d: Path, hidden_states: np.ndarray, lm_head: np.ndarray | None = None,
                     untied: bool = False) -> np.ndarray:
    """(K, n, V) float64 logits of the checkpoint in ``d`` for last hidden states (n, H), as
    upstream's forward computes them (``lm_head``: the base model's, for version-2 heads)."""
    from safetensors.torch import load_file

    cfg = json.loads((d / "config.json").read_text())
    state = load_file(str(d / WEIGHTS))
    K, L = cfg["medusa_num_heads"], cfg["medusa_num_layers"]
    own = str(cfg.get("version", "")) != "2"
    H = hidden_states.shape[1]
    V = state[f"0.{L}.weight"].shape[0] if own else lm_head.shape[0]
    heads = medusa_heads(K, L, H, V, own_output=own, untied=untied).to(torch.float64)
    heads.load_state_dict({k: v.to(torch.float64) for k, v in state.items()}, strict=True)
    h = torch.as_tensor(hidden_states, dtype=torch.float64)
    with torch.no_grad():
        out = [heads[k](h) for k in range(K)]
        if not own:
            out = [x @ torch.as_tensor(lm_head, dtype=torch.float64).T for x in out]
    return torch.stack(out).numpy()
