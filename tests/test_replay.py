"""edgespec.bench.replay and .policies on synthetic traces and devices (no model, no recorded traces)."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass, field

import numpy as np
import pytest

from edgespec.bench import policies as pol
from edgespec.bench import replay, simulate
from edgespec.bench.trace import Trace, TraceSet
from edgespec.sampling import SamplingParams
from edgespec.schedule import Scheduler
from edgespec.schedule.costs import K_MAX

T = (0.0, *(0.9 + 0.1 * k for k in range(1, K_MAX + 1)))  # T(k) = 0.9 + 0.1·k ms: T(1) = 1


@dataclass
class Dev:
    """A device as edgespec.bench.devices describes one: T(k) in ms, drafter costs as fractions of T(1)."""

    name: str = "synthetic"
    t_ms: tuple[float, ...] = T
    draft: dict[str, tuple[float, float]] = field(default_factory=lambda: {
        "ngram": (0.0, 0.0), "history": (0.0, 0.0), "model": (0.0, 0.3), "head": (0.0, 0.05),
        "mtp": (0.0, 0.1), "assistant": (0.0, 0.3)})
    ctx_us: float = 0.0

    def read_ms(self, kind: str) -> float:
        return 0.1 * self.draft[kind][1] * self.t_ms[1]

    def draft_ms(self, kind: str, gamma: int) -> float:
        fixed, per_token = self.draft[kind]
        return (fixed + per_token * gamma) * self.t_ms[1] if gamma > 0 else 0.0


def bandwidth_bound(name: str = "f32", head_ms: float = 1.0) -> Dev:
    """SmolLM2 F32 on the Xeon (commit f1c3d41): T(1) 22 ms, 3.4 ms a token at T(16), 2.5 at T(32)."""
    t = [0.0] + [22.0 + (54.4 - 22.0) * (k - 1) / 15 if k <= 16 else 54.4 + (80.0 - 54.4) * (k - 16) / 16
                 for k in range(1, K_MAX + 1)]
    d = Dev(name, tuple(t))
    d.draft = dict(d.draft, head=(0.0, head_ms / t[1]), model=(0.0, 0.25))
    return d


def trace(task: str, output: list[int], drafts: list[list[int]], category: str = "c", prompt_len: int = 10,
          confidence=None, accept=None, support=None) -> Trace:
    return Trace(task, category, prompt_len, list(output), False, len(output), [list(d) for d in drafts],
                 confidence, support, accept)


def trace_set(traces: list[Trace], kind: str = "ngram", drafter: str | None = None, temperature: float = 0.0,
              target: str = "t") -> TraceSet:
    return TraceSet(target, drafter or kind, kind, temperature, K_MAX - 1, {k: T[k] for k in range(1, K_MAX + 1)},
                    0.0, 0.0, "test", "", "", traces)


def random_trace(rng: np.random.Generator, task: str, n: int = 120, hit: float = 0.6, category: str = "c",
                 longest: int = K_MAX - 1, confident: bool = False, sampled: bool = False) -> Trace:
    """Drafts right for a geometric number of tokens (P(next right) = hit), then wrong."""
    out = [int(x) for x in rng.integers(1000, 2000, n)]
    drafts, conf = [], []
    for p in range(n):
        m = 0
        while m < longest and rng.random() < hit:
            m += 1
        d = out[p:p + m] + [-1 - i for i in range(longest - min(m, n - p))]
        drafts.append(d[:longest])
        conf.append([0.9 if i < m else 0.3 for i in range(len(drafts[-1]))])
    return trace(task, out, drafts, category, confidence=conf if confident else None,
                 accept=[hit] * n if sampled else None)


def test_greedy_acceptance_is_exactly_the_match():
    out = list(range(100, 110))
    drafts = [out[p:p + 3] + [7] for p in range(10)]  # right 3, then wrong
    drafts[2] = [102, 5, 104]  # right 1, then wrong (a later right token does not count)
    drafts[4] = [105, 106]  # what follows the next token: nothing right
    task = simulate.prepare(trace("a", out, drafts), 0.0)
    want = [min(3, 10 - p - 1) for p in range(10)]
    want[2], want[4] = 1, 0
    assert task.run == want  # capped by the tokens left after p's own: the last is the target's


def test_auto_accepts_exactly_the_match_of_what_it_verifies(monkeypatch):
    rng = np.random.default_rng(1)
    ts = trace_set([random_trace(rng, f"t{i}", hit=0.7) for i in range(3)])
    seen = []
    observe = Scheduler.observe

    def spy(self, draft, accepted, *a, **k):
        seen.append((list(draft.tokens), accepted))
        return observe(self, draft, accepted, *a, **k)

    monkeypatch.setattr(Scheduler, "observe", spy)
    res = simulate.run_auto([(ts, [simulate.prepare(t, 0.0) for t in ts.traces])], Dev())
    assert sum(r.tokens for r in res) == 360 and any(d for d, _ in seen)
    for draft, acc in seen:
        assert acc <= len(draft)
    # replay each cycle's verdict: the accepted count is the draft's match with the output there
    pos, t, i = 0, 0, 0
    for draft, acc in seen:
        out = ts.traces[t].output
        m = 0
        while m < len(draft) and pos + m < len(out) - 1 and draft[m] == out[pos + m]:
            m += 1
        assert acc == m
        pos += acc + 1
        if pos >= len(out):
            t, pos, i = t + 1, 0, i + 1


def test_fixed_gamma_time_by_hand_on_three_cycles():
    out = [10, 11, 12, 13, 14, 15, 16]
    drafts = [[10, 11, 99], [11], [12], [13], [14, 15, 16], [15], [16]]
    tr = trace("h", out, drafts, prompt_len=100)
    dev = Dev(ctx_us=10.0)
    dev.draft = dict(dev.draft, model=(0.5, 0.2))
    c = simulate.Costs(dev, "model")
    res = simulate.run_controller(simulate.prepare(tr, 0.0), c, pol.Fixed(3))
    # cycle 1 at p=0: 3 drafted, 2 right -> emits 3; p=3: draft [13] (1 offered), right -> emits 2;
    # p=5: draft [15], right, but only 1 token left after p=5's own -> emits 2; done (7 tokens); after the
    # first draft, every accepted token is already in the drafter's cache: nothing more to read
    ctx = 0.01  # ms per query token and cached token beyond 64
    t = lambda k, c0: T[k] + k * ctx * (c0 - 64)  # noqa: E731
    draft = lambda g: 0.5 + 0.2 * g  # noqa: E731  (T(1) = 1)
    read = 99 * 0.1 * 0.2  # the first draft reads the 99 prompt tokens before the pending one (0.1 of a drafted token each)
    want = (read + draft(3) + t(4, 99)) + (draft(1) + t(2, 102)) + (draft(1) + t(2, 104))
    assert res.ms == pytest.approx(want)
    assert res.cycles == 3 and res.tokens == 7
    assert res.plain_ms == pytest.approx(sum(t(1, 99 + p) for p in range(7)))


def test_oracle_of_a_copy_task_by_hand():
    out = list(range(100, 140))  # 40 tokens, every draft right to the end
    tr = trace("copy", out, [out[p:p + 31] for p in range(40)], prompt_len=10)
    # best: two cycles emitting 40 tokens (K_MAX = 32: e.g. 32 + 8): 2·0.9 + 40·0.1 = 5.8 for 40 T(1)
    c = simulate.Costs(Dev(), "ngram")
    assert simulate.oracle([simulate.prepare(tr, 0.0)], [c]).speedup == pytest.approx(40 / 5.8)


@pytest.mark.parametrize("kind", ["ngram", "model"])
def test_oracle_beats_every_fixed_gamma_and_controller(kind):
    rng = np.random.default_rng(2)
    dev = bandwidth_bound()
    c = simulate.Costs(dev, kind)
    for i in range(4):
        task = simulate.prepare(random_trace(rng, f"t{i}", hit=0.3 + 0.2 * i, confident=True), 0.0)
        best = simulate.oracle([task], [c]).ms
        for g in range(1, K_MAX):
            assert best <= simulate.run_controller(task, c, pol.Fixed(g)).ms + 1e-9
        for ctrl in replay.controllers(kind).values():
            assert best <= simulate.run_controller(task, c, ctrl).ms + 1e-9


@pytest.mark.parametrize("kind", ["ngram", "model"])
def test_an_always_wrong_drafter_leaves_auto_at_plain(kind):
    rng = np.random.default_rng(3)
    ts = trace_set([random_trace(rng, f"t{i}", n=200, hit=0.0, confident=True) for i in range(4)], kind=kind)
    for dev in (Dev(), bandwidth_bound()):
        res = replay.replay_set(ts, dev)
        assert replay.total(res["auto"]) >= 0.98
        assert min(r.speedup for r in res["auto"]) >= 0.95
        assert replay.total(res["oracle"]) == pytest.approx(1.0)


@pytest.mark.parametrize("hit", [0.0, 0.8])
def test_a_warm_replay_starts_from_the_record_an_engine_keeps(monkeypatch, tmp_path, hit):
    """auto-warm: the first pass's generations, folded as Pricing.remember writes them to disk, are the
    record the second pass's scheduler starts from, as an engine reads it back."""
    from edgespec import calibration
    from edgespec.schedule.acceptance import Learned

    rng = np.random.default_rng(5)
    ts = trace_set([random_trace(rng, f"t{i}", hit=hit, confident=True) for i in range(4)], kind="model")
    members = [(ts, [simulate.prepare(t, 0.0) for t in ts.traces])]
    dev, path = bandwidth_bound(), tmp_path / "pair"
    judged, priors = [], []
    gen, init = Learned.generation_judged, Learned.__init__
    monkeypatch.setattr(Learned, "generation_judged", lambda self: judged.append(gen(self)) or judged[-1])
    monkeypatch.setattr(Learned, "__init__", lambda self, *a: priors.append(a) or init(self, *a))
    cold, record = simulate._run_auto(members, dev, None)  # one record per member
    assert len(judged) == 4 and priors == [(None,)]
    for passed, n in judged:
        calibration.save_acceptance(path, passed, n)
    assert record[0] == pytest.approx(json.loads(path.read_text())["judged"])
    on_disk = calibration.load_acceptance(path)
    assert on_disk is not None and on_disk == pytest.approx(record[0][0] / record[0][1])
    warm = simulate.run_autos(members, dev)["auto-warm"]
    assert priors[-1] == pytest.approx((on_disk,))  # the acceptance, as Pricing.scheduler passes it
    assert replay.total(warm) >= replay.total(cold) * 0.999  # what the record says is not paid for again


def test_sampled_replay_follows_accept():
    out = list(range(50))
    drafts = [out[p:p + 8] for p in range(50)]
    sure = simulate.prepare(trace("s", out, drafts, accept=[1.0] * 50), 0.7)
    assert sure.run == [min(8, 50 - p - 1) for p in range(50)]
    never = simulate.prepare(trace("s", out, drafts, accept=[0.0] * 50), 0.7)
    assert never.run == [0] * 50
    half = simulate.prepare(trace("s", out, drafts, accept=[0.5] * 50), 0.7)
    assert half.run == simulate.prepare(trace("s", out, drafts, accept=[0.5] * 50), 0.7).run  # fixed seed
    c = simulate.Costs(Dev(), "ngram")
    # the expected-time oracle: accept = 1 is the greedy oracle of right drafts; lower accept, slower
    greedy = simulate.oracle([simulate.prepare(trace("s", out, drafts), 0.0)], [c])
    assert simulate.oracle([sure], [c]).ms == pytest.approx(greedy.ms)
    assert simulate.oracle([half], [c]).ms > greedy.ms


def test_trace_drafter_honours_stop_and_the_position():
    out = list(range(20))
    tr = trace("d", out, [out[p:p + 6] for p in range(20)], prompt_len=5,
               confidence=[[0.9, 0.8, 0.2, 0.9, 0.9, 0.9] for _ in range(20)], support=[3] * 20)
    ts = trace_set([tr], kind="model")
    clock = simulate.Clock()
    d = simulate.TraceDrafter(ts, simulate.Costs(Dev(), "model"), clock)
    d.new_task(tr)
    got = d.draft([0] * 5 + out[:4], 6, SamplingParams(), None, stop=lambda conf: conf[-1] < 0.5)
    assert got.tokens == [4, 5] and got.confidence == [0.9, 0.8] and got.support == 3
    # 2 tokens drafted (0.3 ms each) after reading the 8 context tokens before the last (0.03 ms each)
    assert got.synced == 8 and clock.now * 1000 == pytest.approx(2 * 0.3 + 8 * 0.03)
    again = d.draft([0] * 5 + out[:6], 2, SamplingParams(), None)  # both drafts accepted: nothing to read
    assert again.synced == 0 and again.tokens == [6, 7]
    assert d.draft([0] * 5, 3, SamplingParams(), None).tokens == [0, 1, 2]
    prior = d.cost_prior()
    assert prior is not None and prior.per_token_ms == pytest.approx(0.3) and not prior.block
    assert simulate.TraceDrafter(trace_set([tr]), simulate.Costs(Dev(), "ngram"), clock).cost_prior() is None


def test_controllers_follow_their_sources():
    hf = pol.HFHeuristic()
    assert hf.ask(31) == 20
    hf.feedback(20, 20, 1.0)
    assert hf.k == 22
    hf.feedback(22, 3, 1.0)
    assert hf.k == 21
    llama = pol.LlamaCpp("model", n_max=3, n_min=2, p_min=0.5)
    assert llama.ask(31) == 3 and llama.keep([0.9, 0.4, 0.9], 3) == (1, 0) and llama.keep([0.9, 0.9], 2) == (2, 2)
    assert pol.LlamaCpp("ngram").ask(31) == 31
    ik = pol.IkAutotune("model", seed=0)
    assert set(ik.coords) == {"n_max", "p_min", "n_min"} and len(ik.coords["n_max"].values) == 16
    assert set(pol.IkAutotune("ngram").coords) == {"n_max", "n_min"} and set(pol.IkAutotune("head").coords) == {"n_max"}
    bee = pol.BeeProfit(15)
    bee.start()
    assert [bee.ask(15) for _ in range(1)] == [0]  # no baseline yet: plain steps first
    for _ in range(3):
        bee.feedback(0, 0, 10.0)
    assert bee.ask(15) == 15  # a baseline, no depth measured: the full depth
    for _ in range(3):
        bee.feedback(15, 0, 40.0, 30.0)  # always wrong, dear
    asked = [bee.ask(15) for _ in range(8) if not bee.feedback(0, 0, 10.0)]
    assert asked[-1] == 0 and bee.off  # off after 8 losing decisions


def test_chain_replay_and_summary_line(monkeypatch, capsys, tmp_path):
    rng = np.random.default_rng(4)
    copy = [random_trace(rng, f"t{i}", hit=0.8 if i % 2 else 0.0, category=f"c{i % 2}") for i in range(4)]
    model = []
    for tr in copy:  # the same outputs, a model right ~70% a token, capped at 15
        drafts = []
        for p in range(len(tr.output)):
            m = 0
            while m < 15 and rng.random() < 0.7:
                m += 1
            drafts.append((tr.output[p:p + m] + [-7] * 15)[:15])
        model.append(trace(tr.task, tr.output, drafts, tr.category, confidence=[[0.8] * 15] * len(drafts)))
    sets = [trace_set(copy, "ngram"), trace_set(model, "model", drafter="small")]
    assert [[s.drafter for s in ch] for ch in replay.chains_of(sets)] == [["ngram", "small"]]
    dev = bandwidth_bound()
    res = replay.replay_chain(replay.chains_of(sets)[0], dev)
    assert replay.total(res["oracle"]) >= replay.total(res["auto"]) > 1.0
    for i, ts in enumerate(sets):
        ts.save(tmp_path / f"{i}.json.gz")
    fake = types.ModuleType("edgespec.bench.devices")
    fake.bundled = lambda: ["f32"]
    fake.load_device = lambda name: dev
    monkeypatch.setitem(sys.modules, "edgespec.bench.devices", fake)
    assert replay.main(["--traces", str(tmp_path), "--device", "all"]) == 0
    out = capsys.readouterr().out
    assert "| auto |" in out and "t:ngram,small:T0" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("REPLAY traces=2 devices=1 auto_min_task=") and "auto_vs_oracle_median=" in last
