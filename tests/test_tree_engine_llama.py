"""Draft trees through the engine on llama.cpp: the tiny llama target verifies a draft model's chain
and its ranked alternatives in one tree forward (backends.llama_tree); greedy output == plain output,
token for token, and alternatives are accepted; a path off the first-child chain is evaluated again in
order (backends.llama_tree.keep_path), so the cache is the plain one."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_tree_engine import off_chain  # noqa: F401 (a fixture)

from edgespec.backends.llama_cpp import LlamaCppBackend
from edgespec.drafters.draft_model import DraftModelDrafter
from edgespec.engine import Engine

pytestmark = pytest.mark.real

PROMPTS = ["The weather today is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


@pytest.mark.parametrize("gamma, nodes", [(3, 8), (5, 16)])
def test_greedy_tree_equals_plain_on_llama(tiny_target: Path, tiny_drafter: Path, gamma, nodes, off_chain):  # noqa: F811
    target = LlamaCppBackend(tiny_target, n_ctx=512, threads=1, tree_leaves=nodes)
    model = LlamaCppBackend(tiny_drafter, n_ctx=512, threads=1)
    with Engine(target, DraftModelDrafter(model, target.n_vocab), num_draft=gamma, tree=nodes) as engine:
        for prompt in PROMPTS:
            plain = engine.generate(prompt, max_tokens=48, speculative=False)
            spec = engine.generate(prompt, max_tokens=48)
            assert spec.tokens == plain.tokens, prompt
            assert spec.stats.tree_cycles > 0 and spec.stats.n_accepted > 0
    assert off_chain["off"] > 0, off_chain


def test_an_alternative_kept_leaves_the_plain_cache(tiny_target: Path):
    """After keeping a path off the first-child chain, the next logits are bit for bit those of a
    cache that only ever held the path (kept in place, its freed cells' holes would move them: 3e-3
    here)."""
    import numpy as np

    from edgespec.backends.trees import tree_ops

    tree = LlamaCppBackend(tiny_target, n_ctx=256, threads=1, tree_leaves=4)
    plain = LlamaCppBackend(tiny_target, n_ctx=256, threads=1)
    context = tree.tokenize("The weather today is sunny and")
    for b in (tree, plain):
        b.eval(context[:-1], rows="none")
    ops = tree_ops(tree)
    # root → [a → b, c → d]: keep the second branch (an alternative, then its child)
    tokens, parents = [300, 301, 302, 303], [-1, 0, -1, 2]
    ops.eval_tree(context[-1], tokens, parents)
    ops.keep_path([2, 3])
    plain.eval([context[-1], 302, 303], rows="none")
    assert tree.n_past == plain.n_past
    for t in (400, 401, 402):
        assert np.array_equal(tree.eval([t], rows="last"), plain.eval([t], rows="last"))
    tree.close()
    plain.close()
