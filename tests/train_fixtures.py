"""Feature caches of the tiny target for the head-training tests (train/held-out sequences, target
info, a 512-token draft vocabulary), built in a few seconds; each module wraps ``build_caches`` in its own
module-scoped fixture."""

from __future__ import annotations

LAYERS = (1, 1, 1)  # the tiny target has 2 layers: id 1 is its only valid feature layer
SEQ = 64


def build_caches(tmp_path_factory, tiny_target):
    import torch

    from edgespec.backends.llama_features import LlamaFeatureBackend
    from edgespec.train import prompts as P
    from edgespec.train.data import local_corpus
    from edgespec.train.features import CachePlan, build_cache
    from edgespec.train.pipeline import target_info

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("train")
    texts = list(local_corpus(max_chars=24_000, seed=0))
    with LlamaFeatureBackend(tiny_target, layers=LAYERS, n_ctx=256, threads=1) as be:
        plan = CachePlan(target=str(tiny_target), target_size=1, seq_len=SEQ, corpus_chars=24_000, n_prompts=2,
                         gen_tokens=24)
        train = build_cache(be, root / "train", plan, texts, P.TRAIN_PROMPTS[:2])
        held = build_cache(be, root / "held", plan, [], P.HELDOUT_PROMPTS[:3])
    info = target_info(tiny_target)
    d2t = train.d2t(len(info["tok_embd"]), 512)
    return train, held, info, d2t


def resume_equals_uninterrupted(make, tmp_path):
    """Trainers from `make()`: 4 steps in one run, and 2 steps checkpointed, then loaded (at step 2)
    and run to 4, end with equal weights; returns (uninterrupted, resumed)."""
    import torch

    a = make()
    a.run(max_steps=4)
    b = make()
    b.run(max_steps=2, checkpoint=tmp_path / "ck.pt")
    c = make()
    c.load(tmp_path / "ck.pt")
    assert c.step == 2
    c.run(max_steps=4)
    for (name, x), (_, y) in zip(a.model.state_dict().items(), c.model.state_dict().items()):
        assert torch.equal(x, y), name
    return a, c
