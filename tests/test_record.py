"""edgespec.bench.record: recording drafter traces leaves the output plain decoding's, and records what
each drafter would propose from the true context at every position (the reference backend, whose
distributions are known exactly; one end-to-end run on a tiny GGUF)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from head_cases import reference

from edgespec.backends.reference import ReferenceBackend
from edgespec.bench.record import Recorder, file_name, fit_cost, record, record_tasks
from edgespec.bench.tasks import Task
from edgespec.bench.trace import Trace, TraceSet
from edgespec.drafters.base import DraftCost
from edgespec.drafters.draft_model import DraftModelDrafter
from edgespec.drafters.ngram import NgramDrafter
from edgespec.engine import Engine
from edgespec.sampling import SamplingParams, process_rows

PROMPTS = ["abcabcab", "fedcba", "ecdcecdcec", "dabcabcabd"]
GREEDY = SamplingParams()


def _tasks(max_tokens: int = 40) -> list[Task]:
    return [Task(f"t{i}", "c", (), p, max_tokens) for i, p in enumerate(PROMPTS)]


def _engine(drafter_of=lambda target: NgramDrafter()) -> tuple[Engine, ReferenceBackend]:
    target = ReferenceBackend(6, seed=5)
    return Engine(target, drafter_of(target), num_draft="auto"), target


def _plain(engine: Engine, task: Task, temperature: float, seed: int) -> list[int]:
    engine.reset()
    gen = engine.generate(task.prompt, max_tokens=task.max_tokens, temperature=temperature, seed=seed,
                          speculative=False)
    return gen.tokens + ([engine.target.eos_id] if gen.finish_reason == "eos" else [])


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_output_is_plain_decodings_and_drafts_are_the_ngram_lookups(temperature):
    engine, target = _engine()
    tasks = _tasks()
    drafters = [NgramDrafter(), DraftModelDrafter(target.perturbed(0.8), target.n_vocab)]
    ngram, model = record_tasks(engine, drafters, tasks, temperature, [31, 7], seed=11)
    for n, (task, t, m) in enumerate(zip(tasks, ngram, model)):
        assert t.output == m.output == _plain(engine, task, temperature, 11 + n), task
        assert len(t.drafts) == len(t.output) == len(m.drafts) == len(t.draft_ms)
        assert t.prompt_len == len(PROMPTS[n]) and t.max_tokens == task.max_tokens
        assert t.eos == (t.output[-1] == target.eos_id) and (t.eos or len(t.output) == task.max_tokens)
        assert all(len(d) == 7 for d in m.drafts) and all(len(d) <= 31 for d in t.drafts)
        prompt = target.tokenize(task.prompt)
        if temperature == 0:  # the n-gram drafter, asked afresh at each position
            assert t.accept is None and t.confidence is None
            for p in range(len(t.output)):
                assert t.drafts[p] == NgramDrafter().draft(prompt + t.output[:p], 31, GREEDY, None).tokens
        else:
            assert t.accept is not None and len(t.accept) == len(t.output)
            assert all(0.0 <= a <= 1.0 for a in t.accept + m.accept)
    assert sum(len(d) > 0 for t in ngram for d in t.drafts) > 20


def test_first_token_acceptance_is_sum_of_min_p_q():
    engine, target = _engine()
    params = SamplingParams(0.7)
    draft_model = target.perturbed(0.8)
    task = _tasks()[0]
    ngram, model = record_tasks(engine, [NgramDrafter(), DraftModelDrafter(draft_model, target.n_vocab)],
                                [task], 0.7, [31, 4], seed=3)
    t, m = ngram[0], model[0]
    prompt = target.tokenize(task.prompt)
    for p in (0, 5, 17):
        ctx = prompt + t.output[:p]
        row = process_rows(target.next_logits(ctx)[None], params)[0].dense()  # the target's p
        q0 = process_rows(draft_model.next_logits(ctx)[None], params)[0].dense()
        assert m.accept[p] == pytest.approx(np.minimum(row, q0).sum(), abs=1e-5)
        expected = row[t.drafts[p][0]] if t.drafts[p] else 0.0  # one-hot: p(x̃₁)
        assert t.accept[p] == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("kind", ["draft-model", "eagle3", "dflash"])
def test_drafters_that_sync_stay_right_when_every_draft_is_discarded(kind):
    """A draft model's and a head's drafts at every position are a fresh drafter's from that context."""
    if kind == "draft-model":
        target = ReferenceBackend(6, seed=5)
        drafter = DraftModelDrafter(target.perturbed(0.8), target.n_vocab)
        def fresh():
            return DraftModelDrafter(target.perturbed(0.8), target.n_vocab)
    else:
        ref = reference(kind)
        target, drafter = ref.target, ref.drafter
        def fresh():
            return type(ref.drafter)(ref.fresh(), target)
    engine = Engine(target, drafter, num_draft="auto")
    task = Task("t", "c", (), "abcab", 24)
    (t,), = record_tasks(engine, [drafter], [task], 0.0, [4])
    prompt = target.tokenize(task.prompt)
    for p in range(len(t.output)):
        assert t.drafts[p] == fresh().draft(prompt + t.output[:p], 4, GREEDY, np.random.default_rng(0)).tokens, p


def test_recorder_drafts_with_its_own_rng():
    """The drafters' draws come from the recorder's rng: the same seed, the same sampled drafts."""
    engine, target = _engine(lambda t: DraftModelDrafter(t.perturbed(0.8), t.n_vocab))
    runs = [record_tasks(engine, [engine.drafter], _tasks(12)[:1], 0.7, [5], seed=4)[0][0] for _ in range(2)]
    assert runs[0].drafts == runs[1].drafts and runs[0].output == runs[1].output
    assert isinstance(Recorder([engine.drafter], [5]).rngs[0], np.random.Generator)


def test_root_chances_are_recursive_rejection_samplings():
    """root_chances: each root child's chance of acceptance given the earlier ones were rejected, as
    tree.verify_tree_stochastic accepts them (the frequencies of 40k walks, within 4 standard errors)."""
    from edgespec.bench.record import root_chances
    from edgespec.sampling import Dist
    from edgespec.tree import DraftTree, verify_tree_stochastic

    p = np.array([0.35, 0.3, 0.2, 0.1, 0.05])
    q = np.array([0.1, 0.4, 0.3, 0.15, 0.05])
    tree = DraftTree([1, 2, 0], [-1, -1, -1], np.stack([q] * 3))  # drawn in this order, without replacement
    chances = root_chances(Dist(len(p), None, p), tree)
    assert chances[0] == pytest.approx(min(1.0, p[1] / q[1]))
    rng, params, tried, took = np.random.default_rng(0), SamplingParams(1.0), np.zeros(3), np.zeros(3)
    logits = np.log(np.stack([p] * 4))
    for _ in range(40_000):
        path, _ = verify_tree_stochastic(logits, tree, params, rng)
        j = path[0] if path else 3
        tried[:min(j + 1, 3)] += 1
        if j < 3:
            took[j] += 1
    freq = took / tried
    assert np.all(np.abs(freq - chances) <= 4 * np.sqrt(np.maximum(freq * (1 - freq), 1e-4) / tried)), (freq, chances)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_trees_are_recorded_greedy_and_sampled_side_trees_with_their_chances(temperature):
    """--tree-nodes: the draft model's tree at every position (its chain is the draft); sampled, with each
    root child's chance (and n-gram's trees, which are not side trees, left out)."""
    engine, target = _engine()
    drafters = [NgramDrafter(), DraftModelDrafter(target.perturbed(0.8), target.n_vocab)]
    ngram, model = record_tasks(engine, drafters, _tasks(24)[:2], temperature, [31, 4], seed=2, tree_nodes=8)
    for t, m in zip(ngram, model):
        assert m.trees is not None and len(m.trees) == len(m.output)
        assert all(tokens[:len(d)] == d for (tokens, _, _), d in zip(m.trees, m.drafts))
        if temperature == 0:
            assert t.trees is not None and m.tree_accept is None
        else:
            assert t.trees is None and t.tree_accept is None and m.tree_accept is not None
            assert all(len(a) == sum(par == -1 for par in parents) and all(0 <= x <= 1 for x in a)
                       for a, (_, parents, _) in zip(m.tree_accept, m.trees))
    assert temperature == 0 or any(len(a) > 1 for m in model for a in m.tree_accept)


def test_fit_cost_and_file_names():
    t = Trace("a", "c", 3, [1, 2, 3, 4], False, 4, [[9], [1, 2], [], [1, 2, 3]], draft_ms=[50.0, 3.0, 0.5, 4.0])
    fixed, per_token = fit_cost([t], None)  # the first draft (it read the prompt) is left out
    assert (fixed, per_token) == pytest.approx((1.0, 1.0))  # through (2, 3 ms) and (3, 4 ms)
    same = Trace("a", "c", 3, [1, 2], False, 2, [[1, 2], [3, 4]], draft_ms=[9.0, 7.0])
    assert fit_cost([same], DraftCost(1.5, 2.5)) == (1.5, 2.5)
    assert file_name("models/smollm2-135m-eagle3.gguf", 0.0) == "smollm2-135m-eagle3-t0.json.gz"
    assert file_name("ngram:4:2", 0.7) == "ngram-4-2-t0.7.json.gz"


def test_save_load_round_trip(tmp_path: Path):
    engine, _ = _engine()
    (traces,) = record_tasks(engine, [NgramDrafter()], _tasks(16)[:2], 0.7, [31], seed=1)
    s = TraceSet("ref", "ngram", "ngram", 0.7, 31, {1: 1.0, 2: 1.25}, 0.01, 0.0, "cpu", "abc", "2026-12-05", traces)
    path = s.save(tmp_path / "x" / file_name("ngram", 0.7))
    assert TraceSet.load(path) == s


def test_record_end_to_end_on_a_tiny_gguf(tiny_target: Path):
    """record(): the header (kind, the target's T(k), machine, commit, date), a chain member by member."""
    tasks = [Task("t0", "chat", ({"role": "user", "content": "Say hi."},), "Say hi.", 6)]
    sets = record(str(tiny_target), "ngram,history", tasks, 0.0, threads=1, n_ctx=256)
    assert [(s.drafter, s.kind, s.longest) for s in sets] == [("ngram", "ngram", 31), ("history", "history", 31)]
    assert sets[0].traces[0].output == sets[1].traces[0].output
    for s in sets:
        assert 1 in s.t_forward_ms and s.machine and s.commit and s.date.count("-") == 2
        assert len(s.traces[0].drafts) == len(s.traces[0].output) > 0
