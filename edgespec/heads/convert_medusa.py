"""Published Medusa checkpoints → edgespec's medusa GGUF (``heads.medusa``).

The layout, read from FasterDecoding/Medusa at e2a5d20 (facts only; no code carried over):
config.json is a ``MedusaConfig`` (``medusa_num_heads``, ``medusa_num_layers``,
``base_model_name_or_path``, and ``version: "2"`` for heads without an output matrix), and the
weights are the ``state_dict`` of the ``medusa_head`` ModuleList (medusa/train/train_legacy.py saves
``medusa_lm_head.safetensors``; the model code loads ``medusa_lm_head.pt``, a pickle edgespec never
opens). Head k is ``nn.Sequential(ResBlock × L, nn.Linear(H, V, bias=False))``, so its keys are
``{k}.{j}.linear.weight`` (H, H) and ``{k}.{j}.linear.bias`` (H) for j < L and ``{k}.{L}.weight``
(V, H); a version-2 head stops at the blocks and uses the target's LM head.

Upstream builds the blocks as ``[ResBlock(H)] * L``: one module repeated, so a checkpoint it trains
holds L equal copies. The GGUF keeps every layer's tensors and applies them in order, which for
equal copies is upstream's forward and for distinct ones text-generation-inference's reading of the
same keys (huggingface/text-generation-inference ``server/text_generation_server/layers/medusa.py``
at 91560ed: ``MedusaHead`` loads ``{k}.{j}.linear`` per layer and ``{k}.{L}`` as its output;
``MedusaHeadV2``, the version-2 heads, ``{k}.0.linear`` with the base model's lm_head).

Upstream's loader overrides medusa_num_heads to 5 for published configs that say fewer ("TODO: fix
the uploaded config" in medusa_model.py): the heads converted are the ones the weights hold.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy.typing as npt

from edgespec.heads.hf_checkpoint import Checkpoint, CheckpointError, TargetInfo
from edgespec.heads.medusa import MedusaConfig, output_weight, res_bias, res_weight

LAYOUT = "Medusa"
_KEY = re.compile(r"(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)")


def medusa_layout(config: dict[str, Any]) -> str | None:
    """"Medusa" for a Medusa checkpoint's config.json (it names ``medusa_num_heads``), else None."""
    return LAYOUT if "medusa_num_heads" in config else None


def convert_medusa(ckpt: Checkpoint, target: TargetInfo | None = None,
                   note: Callable[[str], None] | None = None,
                   ) -> tuple[MedusaConfig, dict[str, npt.NDArray[Any]]]:
    """The MedusaConfig and GGUF-named tensors of a Medusa checkpoint, checked against ``target``.

    Args:
        ckpt: the checkpoint (``hf_checkpoint.read_checkpoint``).
        target: the target GGUF's header (hidden size and vocabulary are checked against it); None
            checks the checkpoint alone (a shared-LM-head checkpoint then needs ``vocab_size`` in
            its config).
        note: called with lines worth telling the user (the base model, a head count that differs
            from the config's).

    Returns:
        (config, tensors): float32 weights under their GGUF names.

    Raises:
        CheckpointError (one line) for a missing, unexpected or misshapen tensor, or a size that does
        not fit the target.
    """
    say = note or (lambda _line: None)
    cfg = ckpt.config
    n_layers = _int(ckpt, cfg, "medusa_num_layers", 1)
    names = _gguf_names(ckpt, n_layers)
    n_heads = 1 + max((int(g.split(".")[1]) for g in names), default=-1)
    if n_heads == 0:
        raise CheckpointError(f"{ckpt.path} holds no Medusa head tensors (expected keys like "
                              f"0.0.linear.weight, 0.{n_layers}.weight)")
    said = _int(ckpt, cfg, "medusa_num_heads", n_heads)
    if said != n_heads:
        say(f"{ckpt.path}/config.json says medusa_num_heads={said}, the weights hold {n_heads} heads: "
            f"converting {n_heads}")
    outputs = [k for k in range(n_heads) if output_weight(k) in names]
    if outputs and len(outputs) != n_heads:
        missing = next(k for k in range(n_heads) if k not in outputs)
        raise CheckpointError(f"{ckpt.path} lacks the Medusa tensor {missing}.{n_layers}.weight "
                              f"(head {missing}'s output matrix; other heads have theirs)")
    if outputs and str(cfg.get("version", "")) == "2":
        raise CheckpointError(f"{ckpt.path}/config.json says version 2 (heads share the target's LM head) "
                              f"but the weights hold output matrices ({names[output_weight(0)]})")
    for k in range(n_heads):
        for j in range(n_layers):
            for g, part in ((res_weight(k, j), "linear.weight"), (res_bias(k, j), "linear.bias")):
                if g not in names:
                    raise CheckpointError(f"{ckpt.path} lacks the Medusa tensor {k}.{j}.{part} "
                                          f"(medusa_num_layers={n_layers})")
    first = names[res_weight(0, 0)] if n_layers else names[output_weight(0)]
    H = ckpt.shape(first)[-1]
    _check_size(ckpt, "hidden_size", H, cfg.get("hidden_size"), target)
    if outputs:
        V = ckpt.shape(names[output_weight(0)])[0]
    elif target is not None or "vocab_size" in cfg:
        V = target.n_vocab if target is not None else _int(ckpt, cfg, "vocab_size", 0)
    else:
        raise CheckpointError(f"{ckpt.path}: heads sharing the target's LM head take their vocabulary size "
                              "from the target (none given) or config.json's vocab_size (absent)")
    _check_size(ckpt, "vocab_size", V, cfg.get("vocab_size"), target)
    config = MedusaConfig(n_heads=n_heads, n_layers=n_layers, n_embd=H, n_vocab=V, shared_lm_head=not outputs)
    for g, shape in config.shapes().items():  # before any tensor is read
        if ckpt.shape(names[g]) != shape:
            raise CheckpointError(f"{ckpt.path}: {names[g]} has shape {list(ckpt.shape(names[g]))}, "
                                  f"expected {list(shape)}")
    tensors = {g: ckpt.array(n) for g, n in names.items()}
    base = cfg.get("base_model_name_or_path")
    say(f"{ckpt.path}: {n_heads} Medusa heads of {n_layers} residual block(s)"
        f"{', sharing the target LM head' if not outputs else ''}{f', trained on {base}' if base else ''}")
    return config, tensors


def _gguf_names(ckpt: Checkpoint, n_layers: int) -> dict[str, str]:
    """GGUF tensor name → checkpoint name; CheckpointError naming any tensor with no place."""
    out, unknown = {}, []
    for name in ckpt.refs:
        m = _KEY.fullmatch(name)
        k, j, part = (int(m[1]), int(m[2]), m[3]) if m else (0, -1, "")
        if 0 <= j < n_layers and part != "weight":
            out[res_weight(k, j) if part == "linear.weight" else res_bias(k, j)] = name
        elif j == n_layers and part == "weight":
            out[output_weight(k)] = name
        else:
            unknown.append(name)
    if any(n.startswith("medusa_head.") for n in unknown):
        raise CheckpointError(f"{ckpt.path} holds a whole model with Medusa heads (medusa_head.*: Medusa-2's "
                              "joint training); edgespec converts head-only checkpoints "
                              "(medusa_lm_head.safetensors)")
    if unknown:
        more = f" (and {len(unknown) - 3} more)" if len(unknown) > 3 else ""
        raise CheckpointError(f"{ckpt.path} has tensors a Medusa head with medusa_num_layers={n_layers} "
                              f"does not have: {', '.join(sorted(unknown)[:3])}{more}")
    return out


def _int(ckpt: Checkpoint, cfg: dict[str, Any], key: str, default: int) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"{ckpt.path}/config.json: {key} must be a non-negative integer "
                              f"(got {value!r})")
    return value


def _check_size(ckpt: Checkpoint, key: str, got: int, config_value: Any, target: TargetInfo | None) -> None:
    """CheckpointError when a size read from the weights differs from config.json's or the target's."""
    hidden = key == "hidden_size"
    what = f"hidden size {got}" if hidden else f"a vocabulary of {got} tokens"
    if config_value is not None and config_value != got:
        raise CheckpointError(f"{ckpt.path}: the weights have {what}, but config.json says "
                              f"{key}={config_value}")
    if target is not None and (target.n_embd if hidden else target.n_vocab) != got:
        theirs = f"hidden size {target.n_embd}" if hidden else f"{target.n_vocab}"
        raise CheckpointError(f"{ckpt.path} has {what}, but target {target.path} has {theirs}")
