"""Draft trees through the engine on MLX (backends.mlx_tree: the tree in the batch axis, per-node
RoPE offsets and an ancestor mask): greedy output == plain output with a draft model's and the n-gram
drafter's trees, alternatives accepted."""

from __future__ import annotations

import pytest
from mlx_fixtures import own_mlx_home  # noqa: F401 (used by pytestmark)
from test_tree_engine import off_chain  # noqa: F401 (a fixture)

pytest.importorskip("mlx.core", reason="mlx is not installed: pip install 'edgespec[mlx]'")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed: pip install 'edgespec[mlx]'")

from edgespec.drafters.draft_model import DraftModelDrafter  # noqa: E402
from edgespec.drafters.ngram import NgramDrafter  # noqa: E402
from edgespec.drafters.registry import open_backend  # noqa: E402
from edgespec.engine import Engine  # noqa: E402

pytestmark = [pytest.mark.real, pytest.mark.usefixtures("own_mlx_home")]
PROMPTS = ["def fibonacci(n):\n", "1, 2, 3, 4, 5,", "Once upon a time, in a village"]


@pytest.mark.parametrize("kind", ["pair", "ngram"])
def test_greedy_tree_equals_plain_on_mlx(kind, tiny_target, tiny_drafter, off_chain):  # noqa: F811
    target = open_backend(tiny_target, "mlx", n_ctx=512)
    drafter = (DraftModelDrafter(open_backend(tiny_drafter, "mlx", n_ctx=512), target.n_vocab) if kind == "pair"
               else NgramDrafter())
    with Engine(target, drafter, num_draft=3, tree=8) as engine:
        for text in PROMPTS:
            prompt = f"{text} {text}"  # its tail occurs earlier: the n-gram drafter has matches
            plain = engine.generate(prompt, max_tokens=32, speculative=False)
            spec = engine.generate(prompt, max_tokens=32)
            assert spec.tokens == plain.tokens, prompt
            assert spec.stats.tree_cycles > 0
    if kind == "pair":
        assert off_chain["off"] > 0, off_chain


@pytest.mark.parametrize("kind", ["pair", "ngram"])
def test_greedy_auto_trees_equal_plain_on_mlx(kind, tiny_target, tiny_drafter):
    """`--tree auto` on MLX (schedule.trees on a flat T(k), so that trees are taken): greedy == plain."""
    from test_tree_auto import FLAT, _scheduler

    from edgespec.drafters.base import DraftCost
    from edgespec.schedule.trees import TreeScheduling

    target = open_backend(tiny_target, "mlx", n_ctx=512)
    drafter = (DraftModelDrafter(open_backend(tiny_drafter, "mlx", n_ctx=512), target.n_vocab) if kind == "pair"
               else NgramDrafter(n_max=3, n_min=1))  # short n-grams: several continuations, so alternatives
    trees = 0
    with Engine(target, drafter, num_draft="auto", tree="auto") as engine:
        sched = TreeScheduling(_scheduler(FLAT, DraftCost(0.5, 1.0) if kind == "pair" else None), 16)
        # the first: its suffix " x y" has two continuations (the tiny target's own text never repeats, so
        # what the scheduler learns of the n-gram drafter on the others makes drafting lose)
        for prompt in ["a x y 1 x y 2 x y", *(f"{text} {text}" for text in PROMPTS)]:
            plain = engine.generate(prompt, max_tokens=32, speculative=False)
            spec = engine.generate(prompt, max_tokens=32, scheduler=sched)
            assert spec.tokens == plain.tokens, prompt
            trees += spec.stats.tree_cycles
    assert trees > 0
