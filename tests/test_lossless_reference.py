"""Losslessness on the reference backend, whose next-token distribution is known exactly.

Greedy: speculative output == plain output, token for token. Sampled (T=0.8, top-p 0.95): the
distribution of each generated position over 10⁵ speculative generations is within TV 0.01 of
the exact distribution (and of 10⁵ plain generations, run once for the module), for a drafter with
a full q (a perturbed draft model) and a one-hot q (n-gram).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from edgespec.backends.reference import ReferenceBackend
from edgespec.drafters.chain import DrafterChain
from edgespec.drafters.draft_model import DraftModelDrafter
from edgespec.drafters.ngram import NgramDrafter
from edgespec.engine import Engine
from edgespec.sampling import SamplingParams, process

PROMPTS = ["abcabcab", "aaaa", "fedcba", "abababab", "cafe", "bead", "deadbeef", "acedb", "ffffabcf", "ba",
           "ecdcecdcec", "dabcabcabd"]


@pytest.fixture
def fixed_costs(monkeypatch):
    """-k auto on the reference backend with known costs (T(k) = 1 + 0.1(k−1) ms, drafts 0.05 ms)
    instead of the microsecond numpy timings, so that the scheduler does speculate."""
    from edgespec import calibration as profile
    from edgespec.schedule.scheduler import CostModel

    monkeypatch.setattr(profile, "calibrate", lambda backend, ks=profile.CALIBRATION_KS, **kw: {
        k: 0.05 if tuple(ks) != profile.CALIBRATION_KS else 1 + 0.1 * (k - 1) for k in ks})  # a drafter: 0.05
    monkeypatch.setattr(profile, "context_cost", lambda backend, **kw: 0.0)
    monkeypatch.setattr(CostModel, "observe_verify", lambda self, *args: None)
    monkeypatch.setattr(CostModel, "observe_draft", lambda self, *args: None)


def _drafters(target: ReferenceBackend):
    model = DraftModelDrafter(target.perturbed(0.8), target.n_vocab)
    return {"ngram": NgramDrafter(), "draft-model": model,
            # a chain: one-hot n-gram drafts and full-q model drafts verified in the same generations
            "chain": DrafterChain([_Counting(NgramDrafter()),
                                   _Counting(DraftModelDrafter(target.perturbed(0.8), target.n_vocab))])}


class _Counting:
    """A chain member that counts the non-empty drafts it proposed."""

    def __init__(self, drafter) -> None:
        self.drafter, self.name, self.paths, self.proposed = drafter, drafter.name, drafter.paths, 0

    def draft(self, *args, **kw):
        d = self.drafter.draft(*args, **kw)
        self.proposed += bool(d.tokens)
        return d

    def __getattr__(self, name):
        return getattr(self.drafter, name)


def _both_members_verified(engine: Engine, greedy: bool) -> None:
    """A chain's cycles drafted from each member: at a fixed γ both proposed (the first non-empty
    one is verified: n-gram's one-hot q, or else the model's full q); under -k auto the scheduler
    verified proposals of each."""
    if not isinstance(engine.drafter, DrafterChain):
        return
    if engine.num_draft == "auto":
        by_member = engine.pricing.scheduler(engine.drafter, greedy).by_member
        assert set(by_member) == {"ngram", "draft-model"}, by_member
    else:
        assert all(m.proposed > 0 for m in engine.drafter.members)


@pytest.mark.parametrize("gamma", [1, 3, 6, "auto"])
@pytest.mark.parametrize("kind", ["ngram", "draft-model", "chain"])
def test_greedy_spec_equals_plain_exactly(kind, gamma, request):
    if gamma == "auto":
        request.getfixturevalue("fixed_costs")
    target = ReferenceBackend(6, seed=5)
    engine = Engine(target, _drafters(target)[kind], num_draft=gamma)
    n_accepted = 0
    for prompt in PROMPTS:
        plain = engine.generate(prompt, max_tokens=128, speculative=False)
        spec = engine.generate(prompt, max_tokens=128)
        assert spec.tokens == plain.tokens, prompt
        assert len(spec.tokens) == 128 and spec.finish_reason == "length"
        n_accepted += spec.stats.n_accepted
    assert n_accepted > 0  # speculation actually happened
    _both_members_verified(engine, greedy=True)


def _exact_marginals(target: ReferenceBackend, prompt: list[int], params: SamplingParams, n: int):
    """Exact distribution of each of the first n generated tokens, by enumerating all paths."""
    V = target.n_vocab
    marg = np.zeros((n, V))
    paths = {(): 1.0}
    for pos in range(n):
        nxt = {}
        for path, pr in paths.items():
            p = process(target.next_logits(prompt + list(path)), params)
            for t in np.flatnonzero(p):
                nxt[path + (int(t),)] = pr * p[t]
                marg[pos, t] += pr * p[t]
        paths = nxt
    return marg, paths


def _empirical(engine: Engine, prompt: list[int], params: SamplingParams, n: int, draws: int, **kw):
    counts = np.zeros((n, engine.target.n_vocab))
    pairs: dict[tuple[int, int], int] = {}
    for seed in range(draws):
        g = engine.generate(prompt, max_tokens=n, temperature=params.temperature, top_p=params.top_p,
                            seed=seed, **kw)
        counts[np.arange(n), g.tokens] += 1
        key = (g.tokens[0], g.tokens[1])
        pairs[key] = pairs.get(key, 0) + 1
    return counts / draws, pairs


SAMPLED = SamplingParams(temperature=0.8, top_p=0.95)
N_POS, DRAWS = 4, 100_000


def _sampling_target() -> ReferenceBackend:
    return ReferenceBackend(6, seed=3)


@pytest.fixture(scope="module")
def plain_sampled():
    """The plain side of the sampled test, computed once: plain decoding never calls the drafter, so
    its DRAWS seeded generations are the same for every drafter and γ (a third of each test's time)."""
    target = _sampling_target()
    plain, _ = _empirical(Engine(target), target.tokenize("abcabcab"), SAMPLED, N_POS, DRAWS)
    return plain


@pytest.mark.slow
@pytest.mark.parametrize("kind,gamma", [("draft-model", 3), ("ngram", 3), ("draft-model", "auto"), ("chain", 3)])
def test_sampled_spec_matches_target_distribution(kind, gamma, request, plain_sampled):
    from scipy.stats import chisquare

    if gamma == "auto":
        request.getfixturevalue("fixed_costs")
    target = _sampling_target()
    params = SAMPLED
    prompt = target.tokenize("abcabcab")
    n_pos, draws, plain = N_POS, DRAWS, plain_sampled
    exact, paths = _exact_marginals(target, prompt, params, n_pos)
    engine = Engine(target, _drafters(target)[kind], num_draft=gamma)
    spec, spec_pairs = _empirical(engine, prompt, params, n_pos, draws)
    for pos in range(n_pos):
        assert 0.5 * np.abs(spec[pos] - exact[pos]).sum() <= 0.01, (pos, spec[pos], exact[pos])
        assert 0.5 * np.abs(spec[pos] - plain[pos]).sum() <= 0.01, (pos, spec[pos], plain[pos])
        assert 0.5 * np.abs(plain[pos] - exact[pos]).sum() <= 0.01, (pos, plain[pos], exact[pos])
    # the joint of the first two tokens: a goodness-of-fit test against the exact joint
    joint = {}
    for path, pr in paths.items():
        joint[path[:2]] = joint.get(path[:2], 0.0) + pr
    keys = sorted(joint)
    expected = np.array([joint[k] for k in keys]) * draws
    observed = np.array([spec_pairs.get(k, 0) for k in keys])
    assert sum(observed) == draws  # nothing outside the support
    big = expected >= 5
    obs, exp = observed[big], expected[big]
    if (~big).any():  # pool the rare outcomes into one cell
        obs, exp = np.append(obs, observed[~big].sum()), np.append(exp, expected[~big].sum())
    assert chisquare(obs, exp).pvalue > 0.01
    assert engine.last_stats is not None
    # speculation ran: the spec generations accepted drafts
    s = engine.generate(prompt, max_tokens=64, temperature=0.8, top_p=0.95, seed=0).stats
    assert s.n_drafted > 0
    _both_members_verified(engine, greedy=False)


def test_all_paths_enumeration_is_a_distribution():
    target = ReferenceBackend(5, seed=1)
    _, paths = _exact_marginals(target, [0, 1], SamplingParams(0.8, top_p=0.95), 3)
    assert abs(sum(paths.values()) - 1) < 1e-12
    assert all(len(p) == 3 for p in itertools.islice(paths, 10))
