"""KV handoff (backends/llama_kv.py): a draft model that is a quantized copy of the target takes the
target's cache cells instead of evaluating the context; greedy output stays the target's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from real_prompts import PROMPTS

import edgespec
from edgespec.backends.llama_kv import KvHandoff, open_handoff, worth_handing
from edgespec.calibration import HANDOFF_DOUBT, pair_path, save_acceptance
from edgespec.drafters.draft_model import DraftModelDrafter, open_kv_handoff

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def tiny_q8(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_target's weights as Q8_0: the same model, as a user's quantized draft model is."""
    from edgespec.models import quantize

    out = tmp_path_factory.mktemp("q8") / "tiny-q8_0.gguf"
    quantize(tiny_target, out, "LLAMA_FTYPE_MOSTLY_Q8_0")
    return out


def _backend(path: Path, **kw):
    from edgespec.backends.llama_cpp import LlamaCppBackend

    return LlamaCppBackend(path, n_ctx=kw.pop("n_ctx", 512), threads=2, **kw)


def test_worth_handing_compares_agreement_with_the_target() -> None:
    target = list(range(20))
    assert worth_handing(target, target, target)
    assert worth_handing(target, target, target[:18] + [0, 0])  # 2 of 20 fewer: within the slack
    assert not worth_handing(target, target, target[:10] + [0] * 10)
    assert worth_handing(target, [0] * 20, [0] * 20)  # a drafter no better either way loses nothing


def test_quantized_copy_takes_the_targets_cells(tiny_target: Path, tiny_q8: Path) -> None:
    with _backend(tiny_target) as t, _backend(tiny_q8) as d, _backend(tiny_q8) as own:
        h = open_handoff(t, d)
        assert h is not None and h.ms_per_token > 0 and h.read_ms > 0
        assert t.n_past == 0 and d.n_past == 0  # the probe leaves both caches empty
        ids = t.tokenize(" ".join(PROMPTS))[:40]
        t.eval(ids, rows="none")
        assert h.copy() and d.n_past == len(ids) == t.n_past
        own.eval(ids, rows="none")
        handed, read = d.eval([ids[-1]])[0], own.eval([ids[-1]])[0]
        # cells the F32 target computed stand in for the Q8_0 drafter's own: the same prediction
        assert handed.argmax() == read.argmax()
        assert np.abs(handed - read).max() < 0.05 * (read.max() - read.min())
        d.truncate(10)  # and the copied cache rolls back as its own does
        assert d.n_past == 10


def test_a_new_pair_is_trusted_on_its_shapes_and_its_costs_are_kept(tiny_target: Path, tiny_q8: Path, monkeypatch,
                                                                   tmp_path: Path) -> None:
    """A first open times the copy and the drafter's read (no probe: ~1 s of a first generation);
    a later one times nothing; the draft model's cost prior reads its read cost from the handoff."""
    from edgespec import calibration

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    monkeypatch.setattr(KvHandoff, "probe", lambda self, tokens: pytest.fail("a pair never seen was probed"))
    with _backend(tiny_target) as t, _backend(tiny_q8) as d:
        h = open_kv_handoff(t, d)
        assert h is not None and h.ms_per_token > 0 and h.read_ms > 0
        assert t.n_past == 0 and d.n_past == 0
        monkeypatch.setattr(KvHandoff, "time_costs", lambda self, tokens: pytest.fail("timed again"))
        again = open_kv_handoff(t, d)
        assert again is not None and (again.ms_per_token, again.read_ms) == (h.ms_per_token, h.read_ms)
        monkeypatch.setattr(calibration, "read_cost", lambda *a, **k: pytest.fail("read timed again"))
        cost = DraftModelDrafter(d, t.n_vocab, again).cost_prior()
        assert cost.catch_up_ms == h.read_ms and cost.copy_ms == h.ms_per_token and cost.per_token_ms > 0
        assert d.n_past == 0


def test_a_pair_whose_drafts_were_seldom_right_is_probed_once(tiny_target: Path, tiny_q8: Path, monkeypatch,
                                                              tmp_path: Path) -> None:
    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    probes: list[int] = []
    monkeypatch.setattr(KvHandoff, "probe", lambda self, tokens: probes.append(len(tokens)) or False)
    with _backend(tiny_target) as t, _backend(tiny_q8) as d:
        assert open_kv_handoff(t, d) is not None and not probes  # trusted at first
        save_acceptance(pair_path(t, [d.path], greedy=True), 0.5 * HANDOFF_DOUBT * 20, 20)
        assert open_kv_handoff(t, d) is None and len(probes) == 1  # in doubt: probed (and refused here)
        assert open_kv_handoff(t, d) is None and len(probes) == 1  # the verdict is kept


def test_no_handoff_across_different_shapes_or_cache_types(tiny_target: Path, tiny8: Path, tiny_q8: Path) -> None:
    with _backend(tiny_target) as t, _backend(tiny8) as other, _backend(tiny_q8, kv_type="f32") as f32:
        assert open_handoff(t, other) is None  # 8 layers against 2
        assert t.kv_type != f32.kv_type and open_handoff(t, f32) is None


def test_a_refused_copy_empties_the_drafter_and_drafting_goes_on(tiny_target: Path, tiny_q8: Path) -> None:
    with _backend(tiny_target, n_ctx=1024) as t, _backend(tiny_q8, n_ctx=256) as d:
        h = KvHandoff(t, d)
        h.read_ms, h.ms_per_token = 1.0, 1e-6
        ids = (t.tokenize(" ".join(PROMPTS)) * 2)[:301]
        t.eval(ids[:300], rows="none")
        d.eval(ids[:5], rows="none")
        assert not h.copy()  # 300 cells do not fit a 256-cell cache: llama.cpp refuses them
        assert d.n_past == 0
        drafter = DraftModelDrafter(d, t.n_vocab, h)
        drafter._kv = list(ids[:5])  # what it believed it held
        draft = drafter.draft(ids, 3, edgespec.SamplingParams(), np.random.default_rng(0))
        # the handoff is dropped, the drafter reads for itself (here: too long for it, so no draft)
        assert drafter.handoff is None and draft.tokens == [] and d.n_past == 0
        short = drafter.draft(ids[:40], 3, edgespec.SamplingParams(), np.random.default_rng(0))
        assert len(short.tokens) == 3 and d.n_past == 42  # 40 read, 2 drafts fed


def _greedy_with_handoff(target: Path, drafter: Path, gamma: int | str, monkeypatch, n_ctx: int = 1024,
                         exact: bool = True) -> None:
    """Greedy with the handoff: spec == plain (exact: a batch-invariant target), or else every emitted
    token is the argmax of a verification row (an F32 target on this CPU, as test_real_greedy checks);
    drafts were made and accepted, and each prompt was handed over, not read."""
    from test_real_greedy import _Recorder

    copies = []
    real_copy = KvHandoff.copy
    monkeypatch.setattr(KvHandoff, "copy", lambda self: copies.append(self.target.n_past) or real_copy(self))
    with edgespec.load(target, drafter=drafter, n_ctx=n_ctx, num_draft=gamma) as engine:
        assert engine.drafter.handoff is not None
        if gamma == "auto":
            engine.calibrate()  # priced now, not learned from a first plain reply (#48: test_first_use.py)
        rec = _Recorder(engine.target)
        for prompt in PROMPTS[:3]:
            engine.target = rec._b
            plain = engine.generate(prompt, max_tokens=48, speculative=False)
            engine.target, rec.blocks = rec, []
            spec = engine.generate(prompt, max_tokens=48)
            if exact:
                assert spec.tokens == plain.tokens
            else:
                rows = np.concatenate([b for b in rec.blocks if len(b)])
                assert set(spec.tokens) <= set(np.argmax(rows, axis=1).tolist())
            assert spec.stats.n_drafted > 0 and spec.stats.n_accepted > 0
        engine.target = rec._b
    assert copies and max(copies) > 8


def test_greedy_with_handoff_equals_plain(tiny_target: Path, tiny_q8: Path, monkeypatch) -> None:
    _greedy_with_handoff(tiny_target, tiny_q8, 3, monkeypatch)


@pytest.mark.real
def test_auto_hands_over_on_a_pair_that_pays(smollm2_f32_path: Path, smollm2_path: Path, monkeypatch) -> None:
    """-k auto with the handoff, priced from the pair's own measured costs: SmolLM2 F32 and its Q4_1
    release (a draft step ~0.6 of the target's here), where drafting pays, so auto drafts from the
    first cycle and hands each prompt over. (Not the tiny 2-layer pair: its Q8_0 copy steps at
    0.6-0.9 of the F32 target's, all overhead, where the cost model gives drafting at 0.95 acceptance
    1.0-1.2x, around the 1.02x at which auto tries a costly drafter at once: whether it drafts there
    is the machine's timing noise, not a property of the scheduler; docs/testing.md.)"""
    _greedy_with_handoff(smollm2_f32_path, smollm2_path, "auto", monkeypatch, n_ctx=512, exact=False)
