"""One trace replayed under one policy on one device's costs: the simulation edgespec.bench.replay runs
over every (trace set, device, policy).

A cycle at position p verifies γ of the draft recorded there. Greedy: the accepted drafts are exactly
the draft's match with output[p:]. T > 0: drafted position i is accepted with probability
accept[p + i] (one uniform per position from a fixed-seed rng, shared by every policy), up to the first
reject: an approximation (the real draft at p + i would follow sampled, not recorded, tokens). A cycle
costs the drafting the drafter did (all it computed, even what is then cut: a free drafter's 31-token
shadow draft included) plus T(γ + 1, context), T(k, c) = T(k) + k · ctx · (c − 64) with the device's
T(k) and ctx_us; plain decoding costs T(1, c) per token. Speedup = plain time / the policy's time.
At T > 0 `emitted()` gets probs=None: a shadow token is credited when the sampled output equals it,
whose mean for a copying drafter (one-hot q) is p(x̃), the credit the engine's probs give.
Sampled side trees (trace `tree_accept`): `sampled_path` walks `sampled_side_tree`'s tree at p by
recursive rejection, its chain as above, a depth-i sibling by its rank's recorded chance at p + i.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgespec.bench import policies as pol
from edgespec.bench.trace import Trace, TraceSet
from edgespec.calibration import fold, mean_acceptance
from edgespec.drafters.base import Draft, DraftCost
from edgespec.drafters.tree_draft import sibling_counts
from edgespec.sampling import SamplingParams
from edgespec.schedule import ChainScheduler, CostModel, Scheduler
from edgespec.schedule import chain as chain_mod
from edgespec.schedule import scheduler as scheduler_mod
from edgespec.schedule import trees as trees_mod
from edgespec.schedule.costs import K_MAX
from edgespec.schedule.trees import TreeScheduling, siblings_beside
from edgespec.tree import DraftTree
from edgespec.tree_step import within_depth

BASE_CONTEXT = 64  # the context T(k) is profiled after (edgespec.calibration.CONTEXT_TOKENS)


class Costs:
    """A device's true costs for one drafter kind (device: edgespec.bench.devices.Device)."""

    def __init__(self, device: Any, kind: str) -> None:
        self.device, self.kind = device, kind
        self.t = list(device.t_ms)
        self.ctx_ms = device.ctx_us / 1000.0
        self.read_ms = device.read_ms(kind) if kind not in pol.COPYING else 0.0  # per context token caught up

    def verify(self, k: int, context: int) -> float:
        return self.t[k] + k * self.ctx_ms * max(0, context - BASE_CONTEXT)

    def draft(self, n: int) -> float:
        return self.device.draft_ms(self.kind, n) if n > 0 else 0.0

    def prior(self) -> DraftCost | None:
        fixed, per_token = (x * self.t[1] for x in self.device.draft[self.kind])
        if fixed <= 0 and per_token <= 0:
            return None
        return DraftCost(fixed, per_token, block=per_token <= 0, catch_up_ms=self.read_ms)

    def model(self) -> CostModel:
        """The scheduler's starting cost model, as the engine's Pricing builds it."""
        return CostModel.for_drafter({k: self.t[k] for k in range(1, len(self.t))}, self.prior(),
                                     ctx_ms=self.ctx_ms, base_context=BASE_CONTEXT)


@dataclass
class Task:
    """One trace made ready to replay: per position the draft on offer and how much of it passes."""

    trace: Trace
    offer: list[int]  # draft length recorded at p (≤ K_MAX − 1)
    run: list[int]  # drafts that pass if verified (≤ offer, ≤ tokens left after p's own)
    accept: list[float] | None  # T > 0: P(first draft token accepted) per position
    sibling_u: np.ndarray | None = None  # T > 0 with tree_accept: a uniform per (position, sibling rank)


def prepare(trace: Trace, temperature: float, seed: int = 0) -> Task:
    n, out = len(trace.output), trace.output
    offer = [min(len(d), K_MAX - 1) for d in trace.drafts]
    if temperature == 0 or trace.accept is None:
        run = []
        for p, d in enumerate(trace.drafts):
            m, most = 0, min(offer[p], n - p - 1)
            while m < most and d[m] == out[p + m]:
                m += 1
            run.append(m)
        return Task(trace, offer, run, None)
    u = np.random.default_rng([seed, *map(ord, trace.task)]).random(n)
    ok = [float(x) < a for x, a in zip(u, trace.accept)]
    streak, following = [0] * (n + 1), 0
    for p in range(n - 1, -1, -1):
        following = following + 1 if ok[p] else 0
        streak[p] = following
    run = [min(offer[p], streak[p], n - p - 1) for p in range(n)]
    sib = None if trace.tree_accept is None else np.random.default_rng([seed, 1, *map(ord, trace.task)]).random((n, K_MAX))
    return Task(trace, offer, run, list(trace.accept), sib)


@dataclass
class Result:
    task: str
    category: str
    ms: float
    plain_ms: float
    tokens: int
    cycles: float

    @property
    def speedup(self) -> float:
        return self.plain_ms / self.ms


def plain_ms(task: Task, c: Costs) -> float:
    ctx0 = task.trace.prompt_len - 1
    return sum(c.verify(1, ctx0 + p) for p in range(len(task.trace.output)))


def _limit(trace: Trace, p: int) -> int:
    return max(0, min(K_MAX - 1, trace.max_tokens - p - 1))  # as the engine asks


def run_controller(task: Task, c: Costs, ctrl: pol.Controller) -> Result:
    """One task under a draft-length controller (fixed γ, an engine's heuristic). A stateful drafter
    pays, when it drafts, for reading the context it has not seen (the prompt first), as in run_auto."""
    tr, ms, cycles, p = task.trace, 0.0, 0, 0
    n, ctx0 = len(tr.output), tr.prompt_len - 1
    seen = 0  # context tokens the drafter holds
    ctrl.start()
    fixed = type(ctrl) is pol.Fixed  # no confidences, no feedback
    while p < n:
        limit = _limit(tr, p)
        if fixed:
            k = min(ctrl.gamma, limit, task.offer[p])
            computed, g, conf = k, k, None
        else:
            k = min(ctrl.ask(limit), limit, task.offer[p]) if limit else 0
            conf = tr.confidence[p][:k] if tr.confidence is not None and tr.confidence[p] is not None else None
            computed, g = ctrl.keep(conf, k) if k else (0, 0)
        acc = min(g, task.run[p])
        t_draft = c.draft(computed)
        if computed:
            t_draft += max(0, ctx0 + p - seen) * c.read_ms
            seen = ctx0 + p + 1 + acc
        cycle = t_draft + c.verify(g + 1, ctx0 + p)
        if not fixed:
            ctrl.feedback(g, acc, cycle, t_draft)
        ms, cycles, p = ms + cycle, cycles + 1, p + acc + 1
    return Result(tr.task, tr.category, ms, plain_ms(task, c), n, cycles)


def oracle(tasks: list[Task], costs: list[Costs]) -> Result:
    """The least time knowing the output: a dynamic program over positions choosing, at each, the
    member (a chain: any of `tasks`, one per member, same output) and γ; at T > 0 it minimises the
    expected time over the accept[] Bernoulli model. A stateful drafter's reading of the prompt is paid
    once if any draft is made (its catching up after plain steps is not: a ceiling, a little high)."""
    tr = tasks[0].trace
    n, ctx0 = len(tr.output), tr.prompt_len - 1
    best, cyc = [0.0] * (n + 1), [0.0] * (n + 1)
    for p in range(n - 1, -1, -1):
        b, bc = costs[0].verify(1, ctx0 + p) + best[p + 1], 1 + cyc[p + 1]  # a plain step
        for task, c in zip(tasks, costs):
            most = min(task.offer[p], _limit(tr, p), n - p - 1)
            if task.accept is None:
                for g in range(1, most + 1):
                    nxt = p + min(g, task.run[p]) + 1
                    v = c.draft(g) + c.verify(g + 1, ctx0 + p) + best[nxt]
                    if v < b:
                        b, bc = v, 1 + cyc[nxt]
                continue
            s, pre, pre_c = 1.0, 0.0, 0.0  # S_g, Σ_{j<g} (S_j − S_{j+1}) · best[p + j + 1]
            for g in range(1, most + 1):
                s_next = s * task.accept[p + g - 1] if g <= n - p - 1 else 0.0
                pre, pre_c = pre + (s - s_next) * best[p + g], pre_c + (s - s_next) * cyc[p + g]
                s = s_next
                nxt = min(n, p + g + 1)
                v = c.draft(g) + c.verify(g + 1, ctx0 + p) + pre + s * best[nxt]
                if v < b:
                    b, bc = v, 1 + pre_c + s * cyc[nxt]
        best[p], cyc[p] = b, bc
    plain = plain_ms(tasks[0], costs[0])
    ms = min(plain, best[0] + ctx0 * min(c.read_ms for c in costs))
    return Result(tr.task, tr.category, ms, plain, n, cyc[0] if ms < plain else n)


class Clock:
    """Modeled time for the scheduling code (`time.perf_counter`): drafting advances it by the device's
    cost, so a chain scheduler's own timing of its members is the model's, as on a machine."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class TraceDrafter:
    """A Drafter that proposes what a trace recorded at the position the context has reached, and
    spends the device's modeled time on the clock: its draft (a block: every row asked for) and, for
    a stateful drafter (a draft model, a head), reading the context tokens it has not seen
    (`Draft.synced`: its cache holds what it read and drafted; what was accepted of that stays)."""

    paths: tuple[str, ...] = ()

    def __init__(self, traces: TraceSet, costs: Costs, clock: Clock) -> None:
        self.name, self.set, self.costs, self.clock = traces.drafter, traces, costs, clock
        self.sampled_q = traces.temperature > 0 and traces.kind not in pol.COPYING
        # sampled, its trees are side trees with recorded chances (drafters.base.prices_sampled_trees)
        self.sampled_trees = traces.temperature > 0 and all(t.tree_accept is not None for t in traces.traces)
        self.stateful = traces.kind not in pol.COPYING
        self.trace: Trace | None = None
        self._base, self._held = 0, []  # its cache: the context's first _base tokens, then its last draft

    def draft(self, context, gamma, params, rng, stop=None) -> Draft:
        tr = self.trace
        assert tr is not None
        p = len(context) - tr.prompt_len
        tokens = tr.drafts[p][:gamma]
        conf = tr.confidence[p][:len(tokens)] if tr.confidence is not None and tr.confidence[p] is not None else None
        if stop is not None and conf is not None:
            n = next((i for i in range(len(tokens)) if stop(conf[:i + 1])), len(tokens))
            tokens, conf = tokens[:n], conf[:n]
        computed = gamma if tokens and self.costs.device.draft[self.set.kind][1] <= 0 else len(tokens)
        synced = 0
        if self.stateful:
            keep = self._base
            while keep - self._base < len(self._held) and keep < len(context) - 1 \
                    and context[keep] == self._held[keep - self._base]:
                keep += 1
            synced = max(0, len(context) - 1 - keep)  # the last token is fed with the draft anyway
            self._base, self._held = len(context), list(tokens)
        self.clock.now += (self.costs.draft(computed) + synced * self.costs.read_ms) / 1000
        q = np.zeros((len(tokens), 1)) if self.sampled_q and tokens else None  # sampled: not cut afterwards
        support = tr.support[p] if tr.support is not None else None
        return Draft(list(tokens), q, None if conf is None else list(conf), synced=synced, support=support)

    def draft_tree(self, context, max_nodes, max_depth, params, rng, stop=None) -> DraftTree:
        """The tree recorded at this position (bench.trace: `trees`), cut to the depth its chain is
        drafted to (`stop` may end it early, as `draft`), then to its first max_nodes nodes (parents
        come first), drafted at its chain's cost."""
        tr = self.trace
        assert tr is not None
        chain = self.draft(context, max_depth, params, rng, stop)
        p = len(context) - tr.prompt_len
        if self.set.temperature > 0:
            tree = sampled_side_tree(tr, p, chain.tokens, max_nodes)
        else:
            tree = recorded_tree(tr, p, max(1, len(chain.tokens)), max_nodes)
        tree.chain_draft = chain
        return tree

    def new_task(self, trace: Trace) -> None:
        self.trace, self._base, self._held = trace, 0, []

    def cost_prior(self, note=None) -> DraftCost | None:
        return self.costs.prior()

    def reset(self) -> None:  # nothing cached: a trace is read, not run
        pass

    close = reset


@contextlib.contextmanager
def modeled_time(clock: Clock):
    """The scheduling modules read `clock` as their time.perf_counter."""
    mods = (scheduler_mod, chain_mod, trees_mod)
    saved = [m.time for m in mods]
    try:
        for m in mods:
            m.time = clock
        yield
    finally:
        for m, t in zip(mods, saved):
            m.time = t


def run_auto(members: list[tuple[TraceSet, list[Task]]], device: Any) -> list[Result]:
    """Every task of a trace set (a chain: of its members' sets, task by task) under `-k auto`, as the
    engine's loop runs it (Engine._cycle), on modeled time: a pair's first run."""
    return _run_auto(members, device, None)[0]


def recorded_tree(trace: Trace, p: int, depth: int, nodes: int) -> DraftTree:
    """The tree `trace` recorded at position p, cut to `depth`, then to its first `nodes` nodes (parents
    come first)."""
    assert trace.trees is not None
    tokens, parents, conf = trace.trees[p]
    tree = within_depth(DraftTree(tokens, parents, confidence=conf), depth)
    return tree.subtree(range(min(nodes, tree.n_nodes)))


def sampled_side_tree(trace: Trace, p: int, chain: list[int], nodes: int) -> DraftTree:
    """A stand-in for the sampled side tree drafted at p with `chain` (its tokens) and up to `nodes`
    nodes: beside the chain's token at depth i the siblings side_tree gives that depth (its rule, with
    each depth's chain token probability recorded at p + i), at most as many as were recorded at p + i,
    whose chances stand for them (sampled_path). Tokens are stand-ins (chain 0, siblings 1, 2, ...)."""
    assert trace.trees is not None and trace.tree_accept is not None
    d, n = min(len(chain), nodes), len(trace.output)
    qx = [trace.trees[p + i][2][0] if p + i < n and trace.trees[p + i][0] else 1.0 for i in range(d)]
    reach = np.cumprod([1.0, *qx[:-1]]) if d else []
    counts = sibling_counts([reach[i] * (1.0 - qx[i]) for i in range(d)], nodes - d)
    counts = [min(c, len(trace.tree_accept[p + i]) - 1 if p + i < n else 0) for i, c in enumerate(counts)]
    tokens, parents = [0] * d, list(range(-1, d - 1))
    for i, c in enumerate(counts):
        tokens += range(1, c + 1)
        parents += [i - 1] * c
    width = max(counts, default=0) + 1
    return DraftTree(tokens, parents, np.full((len(tokens), width), 1.0 / width), side_leaves=True)


def sampled_path(tree: DraftTree, task: Task, p: int) -> list[int]:
    """The path recursive rejection sampling accepts in a sampled_side_tree at p: the chain's token at
    depth i passes as a chain's does (task.run), else each of its siblings in turn with the chance
    recorded for its rank at p + i (task.sibling_u: fixed uniforms)."""
    assert task.trace.tree_accept is not None and task.sibling_u is not None
    chain, path, n = tree.first_chain(), [], len(task.trace.output)
    for i, sibs in enumerate(siblings_beside(tree, chain)):
        if p + i >= n - 1:
            break
        if i < task.run[p]:
            path.append(chain[i])
            continue
        chances = task.trace.tree_accept[p + i]
        path += next(([s] for j, s in enumerate(sibs, 1) if task.sibling_u[p + i, j] < chances[j]), [])
        break
    return path


def tree_path(tree: DraftTree, output: list[int], p: int) -> list[int]:
    """The path greedy verification accepts in `tree` at position p: children matching output[p:]."""
    path, node = [], -1
    while p + len(path) < len(output) - 1:
        node = next((c for c in tree.children(node) if tree.tokens[c] == output[p + len(path)]), None)
        if node is None:
            break
        path.append(node)
    return path


def run_autos(members: list[tuple[TraceSet, list[Task]]], device: Any) -> dict[str, list[Result]]:
    """run_auto as `auto` (a pair's first run) and `auto-warm` (a pair run before: its schedulers start
    from the pair records, edgespec.calibration.fold, that first run left, as an engine starts from
    what earlier ones kept on disk)."""
    first, records = _run_auto(members, device, None)
    return {"auto": first, "auto-warm": _run_auto(members, device, records)[0]}


def _run_auto(members: list[tuple[TraceSet, list[Task]]], device: Any, records: list[list[float]] | None,
              tree_nodes: int = 0) -> tuple[list[Result], list[list[float]]]:
    """run_auto's results, each scheduler starting from its member's record (None: no record), and
    the records after every task's generation is folded in; `tree_nodes` > 0: a single member's
    recorded trees priced against its chain every cycle (schedule.trees.TreeScheduling)."""
    clock = Clock()
    costs = [Costs(device, ts.kind) for ts, _ in members]
    drafters = [TraceDrafter(ts, c, clock) for (ts, _), c in zip(members, costs)]
    records = [list(r) for r in records] if records else [[0.0, 0.0] for _ in members]
    scheds = [Scheduler(c.model(), mean_acceptance(r)) for c, r in zip(costs, records)]
    chain = ChainScheduler(list(zip(drafters, scheds))) if len(members) > 1 else None
    sched: Any = chain or (TreeScheduling(scheds[0], tree_nodes) if tree_nodes else scheds[0])
    temp = members[0][0].temperature
    params, rng = SamplingParams(temperature=temp), np.random.default_rng(0)
    out = []
    with modeled_time(clock):
        for i, task in enumerate(members[0][1]):
            tr = task.trace
            n, ctx0, ms, cycles, p = len(tr.output), tr.prompt_len - 1, 0.0, 0, 0
            for d, (_, tasks) in zip(drafters, members):
                d.new_task(tasks[i].trace)
            sched.new_generation(tr.prompt_len, tr.max_tokens)
            context = [0] * tr.prompt_len + tr.output  # the prompt's tokens are never compared
            while p < n:
                limit = _limit(tr, p)
                t0 = clock.now
                d_, dec = sched.draft(None if chain else drafters[0], context[:tr.prompt_len + p], limit, params,
                                      rng) if limit else (Draft([]), None)
                t_draft = (clock.now - t0) * 1000
                g = len(d_.tokens)
                who = 0 if chain is None or chain.chosen is None else scheds.index(chain.chosen)
                if dec is not None and dec.tree is not None:  # the tree scheduler chose a tree
                    path = sampled_path(dec.tree, task, p) if temp > 0 else tree_path(dec.tree, tr.output, p)
                    acc, t_verify = len(path), costs[0].verify(dec.tree.n_nodes + 1, ctx0 + p)
                    clock.now += t_verify / 1000
                    sched.observe_tree(dec.tree, path, t_draft / 1000, t_verify / 1000, ctx0 + p)
                else:
                    acc = min(g, members[who][1][i].run[p])
                    t_verify = costs[0].verify(g + 1, ctx0 + p)
                    clock.now += t_verify / 1000
                    sched.observe(d_, acc, t_draft / 1000, t_verify / 1000, ctx0 + p)
                sched.emitted(tr.output[p:p + acc + 1], None)
                ms, cycles, p = ms + t_draft + t_verify, cycles + 1, p + acc + 1
            out.append(Result(tr.task, tr.category, ms, plain_ms(task, costs[0]), n, cycles))
            for j, s in enumerate(scheds):  # what the engine keeps after a generation (Pricing.remember)
                passed, judged = s.learned.generation_judged()
                if judged > 0:
                    records[j] = fold(records[j], passed, judged)
    return out, records
