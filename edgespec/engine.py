"""The speculative decoding loop: prefill, cycles of draft → verify → roll back, streaming.

Target KV invariant: `self._kv` lists exactly the tokens in the target's KV cache. The newest
token (`pending`) is never in it yet: each cycle evaluates [pending, x̃₁..x̃γ] in one pass.
A recurrent target (backends/base.py) is checkpointed before that pass; rolling it back restores
the checkpoint and re-evaluates the accepted tokens, a cost the scheduler prices.

The loop asks a scheduler four things (`Scheduling`): `new_generation`, `draft`, `observe`, `emitted`.
Under num_draft="auto" it is the Pricing's for the drafter, unless `stream(scheduler=...)` names another
for that generation (edgespec.bench.record's, which drafts in shadow at every position and records).

A target with no cached cost profile is not timed before its first auto reply: that reply decodes
plainly, its steps are timed as they run, and the rest is timed after it, in the background while
the engine is idle (schedule.first_use; `_time_idle`), a run the next generation stops.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import numpy as np

from edgespec.backends.base import Backend
from edgespec.calibration import CostProfile
from edgespec.drafters.base import Draft, Drafter, can_draft_trees, reusable_prefix
from edgespec.errors import ContextOverflowError, EdgespecError, EngineBusyError
from edgespec.generation import Chunk, Generating, cut
from edgespec.sampling import Dist, SamplingParams
from edgespec.schedule.first_use import StepLog, time_idle
from edgespec.schedule.pricing import Pricing
from edgespec.schedule.rate import Decision
from edgespec.schedule.scheduler import K_MAX, check_num_draft
from edgespec.stats import Stats
from edgespec.text import StopMatcher, StreamDecoder
from edgespec.tree_step import check_tree, tree_cycle, tree_scheduling, verify_tree_cycle
from edgespec.verify import accept_greedy, verify_stochastic

log = logging.getLogger("edgespec")
IDLE_STOP_S = 60.0  # most a generation waits for an idle timing run to stop (one forward, a drafter's prior)
LEARN_REPLIES = 2  # auto replies an unprofiled target decodes plainly; later ones wait for its idle timing


class Scheduling(Protocol):
    """What the loop asks of a scheduler (schedule.scheduler.Scheduler, schedule.chain.ChainScheduler)."""

    def new_generation(self, n_prompt: int, max_tokens: int | None = None) -> None: ...

    def draft(self, drafter: Drafter, context: Sequence[int], limit: int, params: SamplingParams,
              rng: np.random.Generator) -> tuple[Draft, Decision]: ...

    def observe(self, draft: Draft, accepted: int, t_draft: float, t_verify: float,
                context: int | None = None, rollback: float = 0.0) -> None: ...

    def emitted(self, tokens: Sequence[int], probs: Sequence[Dist] | None = None) -> None: ...


class Engine(Generating):
    """A target backend plus an optional drafter, and what they cost (`pricing`: the scheduler's
    source). Use `load()` to build one from model files.

    Not safe for two generations at once; `cancel()` may be called from any thread.
    """

    def __init__(self, target: Backend, drafter: Drafter | None = None, num_draft: int | str = "auto",
                 pricing: Pricing | None = None, tree: int | str = "off") -> None:
        self.target = target
        self.tree, self._tree_ops = check_tree(tree), None  # N: forced trees, "auto": priced (tree_step); 0: off
        self.drafter = drafter  # may be swapped between generations (bench): schedulers are per drafter
        self.pricing = pricing or Pricing(target)
        self.num_draft = check_num_draft(num_draft)
        self.last_stats: Stats | None = None
        self._kv: list[int] = []
        self._cancel = threading.Event()
        self._busy = threading.Lock()
        self._guard = threading.Lock()  # who holds `_busy`: `_idle` is set while an idle timing run does
        self._idle: threading.Event | None = None  # set it to stop the idle timing run
        self._idle_thread: threading.Thread | None = None
        self._abandon = threading.Event()  # closing: an idle run does not even put the cache back
        self._steps: StepLog | None = None  # an unprofiled target's first reply: its plain steps, timed
        self._learning = 0  # auto replies decoded plainly so far to learn the target's costs
        self.idle_error: BaseException | None = None  # what stopped the latest idle timing run, if it failed

    # -- public API -------------------------------------------------------------------------------

    def stream(
        self,
        prompt: str | Sequence[int],
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | None = None,
        num_draft: int | str | None = None,
        stop: Sequence[str] = (),
        speculative: bool = True,
        add_special: bool = True,
        parse_special: bool = False,
        scheduler: Scheduling | None = None,
    ) -> Iterator[Chunk]:
        """Yield chunks as tokens are accepted.

        Args:
            prompt: text (tokenized with the target's tokenizer) or token ids.
            max_tokens: most tokens to generate.
            temperature, top_k, top_p, min_p: sampling; temperature 0 is greedy.
            seed: seeds the sampler (None: fresh entropy).
            num_draft: γ, draft tokens per cycle, or "auto": the scheduler picks γ (0 = a plain
                step) every cycle from measured costs and acceptance (default: the engine's).
            stop: strings that end the generation (not included in the text).
            speculative: False decodes plainly through the same backend (the baseline).
            add_special, parse_special: tokenizer flags for a text prompt.
            scheduler: under num_draft "auto", schedules this generation instead of the Pricing's
                (whose record of the pair it then leaves alone): a research hook (bench.record).
        """
        params = SamplingParams(temperature, top_k, top_p, min_p)
        gamma = check_num_draft(self.num_draft if num_draft is None else num_draft)
        if max_tokens < 1:
            raise EdgespecError(f"max_tokens must be >= 1 (got {max_tokens})")
        if not speculative or self.drafter is None:
            gamma = 0
        check_tree(self.tree, gamma)
        # the lock comes before anything that touches the target: calibration resets its KV cache
        # generations stop an idle timing run, until LEARN_REPLIES were plain: then they wait for it
        # (back-to-back requests would stop every one, and never speculate)
        patient = self._learning >= LEARN_REPLIES
        self._lock(stop_idle=not patient)
        learn = None
        try:
            if gamma == "auto" and scheduler is None and not patient and self.pricing.unknown():
                gamma, learn = 0, StepLog()  # no cost profile: decode plainly, time the steps (first_use)
            elif patient and gamma == "auto" and self.pricing.unknown():  # the idle run was cut short
                self._kv = time_idle(self.pricing, self.drafter, self._kv, threading.Event(), None,
                                     self._abandon)[0]  # timed now, the cache put back
            self._steps = learn
            if gamma != 0:  # pricing may time the target in its KV cache: the context is forgotten then
                self.pricing.measure_exact_batch()
            sched = None if gamma != "auto" else scheduler or tree_scheduling(
                self, self.pricing.scheduler(self.drafter, params.greedy))
            self._forget_evicted()
            ids = (self.target.tokenize(prompt, add_special, parse_special) if isinstance(prompt, str)
                   else [int(t) for t in prompt])
            if not ids:
                raise EdgespecError("the prompt is empty")
            if len(ids) >= self.target.n_ctx:
                raise ContextOverflowError(
                    f"prompt of {len(ids)} tokens does not fit the context of {self.target.n_ctx} tokens "
                    f"(use a shorter prompt or a larger context: n_ctx / --ctx)")
            self._cancel.clear()
            yield from self._run(ids, max_tokens, params, np.random.default_rng(seed), gamma, stop, sched,
                                 remember=scheduler is None)
        finally:
            self._steps = None
            try:
                self._forget_evicted()  # the backend reset itself after an error
                self.target.truncate(len(self._kv))  # drop whatever an interrupted cycle left behind
            finally:
                if learn is not None and learn.steps:
                    self._learning += 1
                    self._start_idle(learn)  # hands the held engine over to the idle timing run
                else:
                    self._busy.release()

    def calibrate(self, note: Callable[[str], None] | None = None, background: bool = False) -> None:
        """Load (or time, and cache per model) the cost profiles that num_draft="auto" starts from:
        T(k) in ≤ 2 s, what each cached token adds in ~2–3 s, the drafter's `cost_prior()`. A target
        with a cached profile is priced at its first auto generation, one without one after its first
        auto reply (which decodes plainly), while the engine is idle; call this to choose when.
        `note` hears of timing. `background`: time in a background run holding the engine, as after
        a first reply, which the next generation stops (`wait_priced` waits for it; nothing is
        started when nothing needs timing or the engine is busy). Refused while the engine is
        generating (timing uses the target's KV cache)."""
        if background:
            if self.num_draft == "auto" and self.drafter is not None and self.pricing.unknown() \
                    and self._busy.acquire(blocking=False):
                self._start_idle(None)
            return
        self._lock()
        try:
            self.pricing.calibrate(self.drafter, note)
            self._forget_evicted()
        finally:
            self._busy.release()

    @property
    def timing(self) -> bool:
        """Whether an idle timing run (after a first reply, or `calibrate(background=True)`) is on."""
        thread = self._idle_thread
        return thread is not None and thread.is_alive()

    def wait_priced(self, timeout: float | None = None) -> bool:
        """Wait for the idle timing run, if one is on; whether the target's costs are known now."""
        thread = self._idle_thread
        if thread is not None:
            thread.join(timeout)
        return not self.timing and not self.pricing.unknown()

    @property
    def costs(self) -> CostProfile | None:
        """What calibration measured (None before it ran): T(k), the context term, the exact batch."""
        return self.pricing.costs

    def cancel(self) -> None:
        """Stop the running generation after its current cycle, or an idle timing run within one
        forward (thread-safe)."""
        self._cancel.set()
        if (idle := self._idle) is not None:
            idle.set()

    def reset(self) -> None:
        """Forget the cached prompt (the next generation evaluates its prompt from scratch); stops an
        idle timing run first."""
        self._lock()
        try:
            self._kv = []
            self.target.truncate(0)
        finally:
            self._busy.release()

    def stop_timing(self) -> None:
        """Stop an idle timing run, if one is on, and wait for it (within one forward)."""
        self._abandon.set()
        if (idle := self._idle) is not None:
            idle.set()
        if self._idle_thread is not None:
            self._idle_thread.join()
        self._abandon.clear()

    def close(self) -> None:
        self.stop_timing()
        if self.drafter is not None:
            self.drafter.close()
        self.target.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _lock(self, stop_idle: bool = True) -> None:
        """Hold the engine: at once, or after an idle timing run, stopped (within one forward) or not."""
        with self._guard:
            if self._busy.acquire(blocking=False):
                return
            idle = self._idle
        if idle is not None:
            if stop_idle:
                idle.set()
            if self._busy.acquire(timeout=IDLE_STOP_S if stop_idle else -1):
                return
        raise EngineBusyError("this engine is already generating; use one engine per concurrent stream")

    def _start_idle(self, steps: StepLog | None) -> None:
        """Hand the engine, held by the caller, to a background timing run (`_time_idle`)."""
        stop = threading.Event()
        with self._guard:
            self._idle = stop
        self._idle_thread = threading.Thread(target=self._time_idle, args=(stop, steps), daemon=True,
                                             name="edgespec-idle-timing")
        self._idle_thread.start()

    def _time_idle(self, stop: threading.Event, steps: StepLog | None) -> None:
        """The idle timing run (schedule.first_use.time_idle), then the engine is free again."""
        try:
            self._kv, error = time_idle(self.pricing, self.drafter, self._kv, stop, steps, self._abandon)
            if error is not None:  # a backend fault: the next auto generation decodes plainly, tries again
                self.idle_error = error
                log.warning("timing the target while idle failed: %s: %s", type(error).__name__, error)
        finally:
            with self._guard:
                self._idle = None
                self._busy.release()

    def _forget_evicted(self) -> None:
        """Keep `_kv` to what the target still holds (pricing and errors reset the target's cache)."""
        del self._kv[self.target.n_past:]

    # -- the loop ---------------------------------------------------------------------------------

    def _run(self, ids: list[int], max_tokens: int, params: SamplingParams, rng: np.random.Generator,
             gamma: int | str, stop: Sequence[str], sched: Scheduling | None, remember: bool = True
             ) -> Iterator[Chunk]:
        stats = self.last_stats = Stats(n_prompt=len(ids))
        if sched is not None:
            sched.new_generation(len(ids), max_tokens)
        t0 = time.perf_counter()
        pending = self._prefill(ids, stats)
        t_prefilled = time.perf_counter()
        stats.t_prefill = t_prefilled - t0
        decoder, stops = StreamDecoder(self.target.token_to_bytes), StopMatcher(stop)
        n_ctx, generated = self.target.n_ctx, 0
        while True:
            room = n_ctx - len(self._kv) - 1  # positions left after `pending`
            if self._cancel.is_set() or room < 0:
                stats.finish(time.perf_counter() - t_prefilled)
                yield Chunk(stops.flush() + decoder.flush(), [], [], "cancelled" if room >= 0 else "length")
                return
            g = max(0, min(K_MAX - 1 if sched else int(gamma), max_tokens - generated - 1, room))
            emitted, n_acc = self._cycle(pending, g, params, rng, stats, sched)
            t_post = time.perf_counter()
            emitted, reason = cut(emitted, generated, max_tokens, self.target.is_eog)
            generated += len(emitted)
            stats.n_tokens = generated
            pending = emitted[-1] if emitted else pending
            text = stops.push(decoder.feed(emitted))
            if stops.hit:
                reason = "stop"
            elif reason is not None:
                text += stops.push(decoder.flush()) + stops.flush()
            flags = [i < n_acc for i in range(len(emitted))]
            stats.t_other += time.perf_counter() - t_post
            if reason is not None:
                stats.finish(time.perf_counter() - t_prefilled)
            if reason is not None and sched is not None and remember:  # what the pair showed, for the next engine
                self.pricing.remember(self.drafter, params.greedy)
            yield Chunk(text, emitted, flags, reason)
            if reason is not None:
                return

    def _prefill(self, ids: list[int], stats: Stats) -> int:
        """Evaluate all prompt tokens but the last, reusing the cached common prefix."""
        n_keep = reusable_prefix(self._kv, ids[:-1], self.target)
        self._kv = self._kv[:n_keep]
        self.target.truncate(n_keep)
        if len(ids) - 1 > n_keep:
            self.target.eval(ids[n_keep:-1], rows="none")
            self._kv.extend(ids[n_keep:-1])
        stats.n_prompt_evaluated = len(ids) - n_keep
        return ids[-1]

    def _cycle(self, pending: int, gamma: int, params: SamplingParams, rng: np.random.Generator,
               stats: Stats, sched: Scheduling | None) -> tuple[list[int], int]:
        """One speculative cycle (γ = 0: a plain step); with a scheduler, `gamma` is only the limit.
        Returns (emitted tokens, drafts accepted)."""
        if self.tree != "auto" and self.tree and gamma > 0 and can_draft_trees(self.drafter):
            return tree_cycle(self, pending, gamma, params, rng, stats)
        t0, n_cached = time.perf_counter(), len(self._kv)
        draft, plan = Draft([]), None
        if gamma > 0:
            context = self._kv  # the committed context = the cache's tokens + pending, without a copy
            context.append(pending)
            try:
                if sched is not None:
                    draft, plan = sched.draft(self.drafter, context, gamma, params, rng)
                else:
                    draft = self.drafter.draft(context, gamma, params, rng)
            finally:
                context.pop()
            if plan is not None and plan.tree is not None:  # the scheduler chose a tree (tree_step)
                return verify_tree_cycle(self, pending, plan.tree, params, rng, stats, t0, sched, plan)
            draft = self._through_end(draft.head(gamma))
        x = draft.tokens  # x̃₁..x̃γ
        q = draft.q[: len(x)] if draft.q is not None else None  # (γ, V)
        t1 = time.perf_counter()
        if x:  # a recurrent target can come back from here only (a no-op for a KV cache)
            self.target.checkpoint()
        rows: list[Dist] | None = [] if sched is not None and not params.greedy else None
        if params.greedy:  # the target's argmax of each row: no logit rows are handed over
            ids = self._verify_pass([pending, *x], greedy=True)
            t2 = time.perf_counter()
            n, token = accept_greedy(ids, x)
        else:
            logits = self._verify_pass([pending, *x])  # (γ+1, V): p₁..p_{γ+1}
            t2 = time.perf_counter()
            n, token = verify_stochastic(logits, x, q, params, rng, rows)
        self._kv.append(pending)
        self._kv.extend(x[:n])
        t_cut = time.perf_counter()
        self.target.truncate(len(self._kv))  # roll back the rejected drafts (recurrent: re-evaluates)
        t3 = time.perf_counter()
        rollback = t3 - t_cut if self.target.recurrent and n < len(x) else 0.0
        if self._steps is not None:
            self._steps.add(n_cached, t3 - t1)
        if sched is not None:
            sched.observe(draft, n, t1 - t0 - (plan.seconds if plan else 0.0), t3 - t1 - rollback, n_cached,
                          rollback=rollback)
            sched.emitted([*x[:n], token], rows)
        stats.record_cycle(len(x), n, t3 - t0, plan, (t1 - t0, t2 - t1, rollback, time.perf_counter() - t2))
        return [*x[:n], token], n

    def _through_end(self, draft: Draft) -> Draft:
        """The draft up to its first end-of-generation token: what follows one can never be
        emitted, so verifying it only costs (a history drafter copies past a reply's end into
        what came next). Lossless: verification of the positions kept is the same either way."""
        end = next((i for i, t in enumerate(draft.tokens) if self.target.is_eog(t)), None)
        return draft if end is None else draft.head(end + 1)

    def _verify_pass(self, tokens: list[int], greedy: bool = False) -> np.ndarray:
        """All logit rows for `tokens` (greedy: their argmax ids), in forwards no longer than the
        target evaluates exactly as single steps (plain decoding's view, Pricing.chunk); usually one."""
        n = self.pricing.chunk or len(tokens)
        forward = self.target.eval_argmax if greedy else lambda chunk: self.target.eval(chunk, rows="all")
        if len(tokens) <= n:
            return forward(tokens)
        return np.concatenate([forward(tokens[i:i + n]) for i in range(0, len(tokens), n)])
