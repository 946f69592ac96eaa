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
