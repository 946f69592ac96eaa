"""What the head-drafter tests share: each kind's reference drafter on ReferenceFeatureBackend (whose
next-token distribution is known exactly) with what its head predicts after a context, the tiny real
heads for the libllama / MLX runtimes (SmolLM2's vocabulary), and the greedy losslessness loop.

A kind's view of a synced head is what it predicts after the context: EAGLE-3 the last pair's logits
and pre-norm h, DFlash the block's logits, DSpark the block's base logits and hiddens (its libllama
block_logits carry llama.cpp's chained Markov bias, which the other runners do not)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from eagle_fixtures import fit_tiny_head, reference_head
from gguf_fixtures import build_tiny_llama
from head_oracles import DFlashHead

from edgespec.backends.reference import ReferenceFeatureBackend
from edgespec.drafters.dflash import DFlashDrafter
from edgespec.drafters.dspark import DSparkDrafter
from edgespec.drafters.eagle import EagleDrafter
from edgespec.drafters.registry import open_backend
from edgespec.heads.dflash import DFlashConfig, random_tensors
from edgespec.heads.dflash_gguf import write_dflash_gguf
from edgespec.heads.dspark import MarkovHead
from edgespec.sampling import SamplingParams
from edgespec.session import Options, plan


def open_target(target: Any = None, drafters: Any = (), backend: str = "llama.cpp", **options: Any) -> Any:
    """The target `drafters` need, by name: plain, or capturing the layers the first head reads."""
    p = plan(target, drafters, backend, **{k: v for k, v in options.items() if k in Options.__dataclass_fields__})
    return open_backend(p.target, backend, p.layers, mtp=p.mtp, **options)

GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95)
N_VOCAB = 49152  # SmolLM2's tokenizer, shared by the tiny targets
BLOCK = 6  # the tiny DFlash / DSpark heads' block
FIT_PROMPTS = ["The history of the city", "def add(a, b):", "Once upon a time", "import numpy as np", "Dear Sir,",
               "The weather today", "SELECT * FROM users", "In 1492, Columbus"]
HELD_OUT = ["The quick brown fox", "Hello, world!", "A long time ago", "What is the capital of France?"]
KINDS = ("eagle3", "dflash", "dspark")
DRAFTER = {"eagle3": EagleDrafter, "dflash": DFlashDrafter, "dspark": DSparkDrafter}
BACKENDS = {"llama": "llama.cpp", "mlx": "mlx"}  # runtime → the target backend it runs beside by default
RUNTIMES = ["llama", pytest.param("mlx", marks=pytest.mark.skipif(
    importlib.util.find_spec("mlx") is None, reason="mlx is not installed: pip install 'edgespec[mlx]'"))]


def greedy_lossless(engine: Any, prompts: Sequence[str], max_tokens: int) -> list[Any]:
    """Assert greedy speculative output == plain greedy output for every prompt; the speculative stats."""
    stats = []
    for prompt in prompts:
        plain = engine.generate(prompt, max_tokens=max_tokens, speculative=False)
        spec = engine.generate(prompt, max_tokens=max_tokens)
        assert spec.tokens == plain.tokens, prompt
        stats.append(spec.stats)
    return stats


# -- reference drafters (fast) ------------------------------------------------------------------------


@dataclass
class Ref:
    """A 6-token reference target, a drafter whose head never drafts 'f' (token 5: its d2t lacks it),
    and `fresh()`: a new head of the same weights."""

    target: ReferenceFeatureBackend
    drafter: Any
    fresh: Callable[[], Any]


def _block_config(target: ReferenceFeatureBackend, **kw: Any) -> DFlashConfig:
    """T = 3 feature blocks of H = 7, B = 5, MASK = token 5."""
    return DFlashConfig(n_embd=target.n_embd, n_layer=1, n_head=1, n_head_kv=1, n_ff=16, target_layers=(1, 2, 3),
                        n_vocab=target.n_vocab, n_draft_vocab=5, mask_token_id=5, block_size=5, n_rot=6,
                        rope_base=10000.0, **kw)


def reference(kind: str, noise: float = 0.3, conf: bool = True) -> Ref:
    """`kind`'s reference drafter: EAGLE-3 a hand-built head (eagle_fixtures.reference_head, `noise`),
    DFlash a random head (std 2), DSpark one with a strong Markov head (std 2, rank 3; a confidence
    head unless not `conf`), so chaining changes drafts."""
    target = ReferenceFeatureBackend(6, seed=3)
    if kind == "eagle3":
        def fresh() -> Any:
            return reference_head(target, noise=noise, d2t=range(5))
        return Ref(target, EagleDrafter(fresh(), target), fresh)
    cfg = _block_config(target, **(dict(markov_rank=3, has_confidence=conf) if kind == "dspark" else {}))
    t = random_tensors(cfg, seed=3, d2t=np.arange(5), std=2.0, own_embd=True)
    drafter = (DSparkDrafter(DFlashHead(cfg, t), target, MarkovHead(cfg, t)) if kind == "dspark"
               else DFlashDrafter(DFlashHead(cfg, t), target))
    return Ref(target, drafter, lambda: DFlashHead(cfg, t))


def view(drafter: Any, ctx: list[int]) -> list[np.ndarray]:
    """Sync `drafter` to `ctx`: what its head then predicts (see the module docstring)."""
    if drafter.name == "eagle3":
        logits, h = drafter.sync(ctx)
        return [logits[None], h]
    drafter.sync(ctx)
    return _block_view(drafter.name, drafter.head, ctx)


def fresh_view(kind: str, head: Any, target: Any, ctx: list[int]) -> list[np.ndarray]:
    """`view` of a new `head` fed the whole committed context at once."""
    feats = target.features(0, len(ctx) - 1)
    if kind == "eagle3":
        return list(head.decode(ctx[1:], head.encode(feats), rows="last"))
    head.inject(feats)
    return _block_view(kind, head, ctx)


def _block_view(kind: str, head: Any, ctx: list[int]) -> list[np.ndarray]:
    block = head.block_tokens(ctx[-1])
    return list(head.forward_block(block)) if kind == "dspark" else [head.block_logits(block)]


def kv(head: Any) -> list[np.ndarray]:
    """A numpy head's KV cache as arrays (the EAGLE-3 head's one layer, a DFlash head's per layer)."""
    k, v = head._k, head._v
    return [k, v] if isinstance(k, np.ndarray) else [*k, *v]


def chain_rows(d: Any, ctx: list[int], tokens: list[int], n: int,
               fresh: Callable[[], Any] | None = None) -> tuple[np.ndarray, list[float] | None]:
    """The logit rows drafter `d`'s draft `tokens` after `ctx` were drawn from (each given the drafts
    before it; a block kind's block holds n drafts), and the head's own confidences (None: derived
    from the rows). EAGLE-3's come from a `fresh` head fed the context at once, as the first draft
    of a drafter with an empty cache computes them."""
    kind = d.name
    if kind == "eagle3":
        assert fresh is not None
        head = fresh()
        logits, h = head.decode(ctx[1:], head.encode(d.target.features(0, len(ctx) - 1)), rows="last")
        rows = [logits[0]]
        for t in tokens[:-1]:
            out, h = head.decode([t], h)
            rows.append(out[0])
        return np.stack(rows), None
    d.sync(ctx)
    z, h = d.head.forward_block(d.head.block_tokens(ctx[-1], n + 1))
    if kind == "dflash":
        return z[1:len(tokens) + 1], None
    prev, m = [ctx[-1], *tokens[:-1]], d.markov
    conf = [m.confidence(h[r + 1], p) for r, p in enumerate(prev)]
    return np.stack([m.apply(z[r + 1], p) for r, p in enumerate(prev)]), (None if conf[0] is None else conf)


# -- tiny real heads (SmolLM2's vocabulary) ------------------------------------------------------------


def tiny_head_config(**kw: Any) -> DFlashConfig:
    """A DFlash head for the 4-layer tiny llama (H 64), reading its layers 1 and 3."""
    return DFlashConfig(**(dict(n_embd=64, n_layer=1, n_head=4, n_head_kv=2, n_ff=128, target_layers=(1, 3),
                                n_vocab=N_VOCAB, n_draft_vocab=N_VOCAB, mask_token_id=N_VOCAB - 1,
                                block_size=BLOCK, rope_base=10000.0) | kw))


# name → (kind, markov_type, rank) of the tiny DSpark heads: F32 rank 8, and rank 32 with the Q8_0
# markov_w1 that shipped heads have
DSPARK = {"dspark": ("f32", 8), "dspark-q8_0": ("q8_0", 32)}


def build_tiny_head(name: str, d: Path, vocab: Path) -> tuple[Path, Path]:
    """(a tiny target, a head GGUF for it) in `d`. "eagle3": an 8-layer target whose layers add little
    (layer_scale 0.1) and a least-squares head (right often); "dflash": the 4-layer tiny llama and a
    random F32 head borrowing its token embeddings and LM head (as published DFlash heads do);
    "dspark", "dspark-q8_0": random heads with a confidence head and a d2t of the first 8192 ids
    with their own LM head (DSPARK)."""
    if name == "eagle3":
        target = build_tiny_llama(d / "tiny8.gguf", vocab_source=vocab, n_layer=8, seed=0, layer_scale=0.1)
        return target, fit_tiny_head(target, d / "tiny8-head.gguf", vocab, FIT_PROMPTS)
    target = d / "tiny4.gguf"
    if not target.exists():
        build_tiny_llama(target, vocab_source=vocab, n_layer=4, seed=0)
    if name == "dflash":
        cfg = tiny_head_config()
        t = {k: v for k, v in random_tensors(cfg, seed=2).items() if k != "output.weight"}
        return target, write_dflash_gguf(d / "dflash.gguf", cfg, t, vocab_source=vocab, weight_type="f32")
    markov_type, rank = DSPARK[name]
    cfg = tiny_head_config(n_draft_vocab=8192, markov_rank=rank, has_confidence=True)
    return target, write_dflash_gguf(d / f"{name}.gguf", cfg, random_tensors(cfg, seed=2), vocab_source=vocab,
                                     weight_type="f32", markov_type=markov_type)
