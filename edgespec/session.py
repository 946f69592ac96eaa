"""Assembling engines: the one place that does it, in three phases.

1. plan (`plan`): file work only. Each spec is read once and each name resolved once; a published
   head checkpoint is converted to GGUF and, on MLX, a GGUF model to MLX (both once, cached); headers
   are read and checked against each other. The
   result is a frozen Plan of resolved paths and drafter plans.
2. open (`Session`): the target and each drafter, through drafters.registry's tables; one Engine
   over them (a bench swaps its drafter between configs).
3. price (`Session.price`): the target's cost profile and each drafter's prior (edgespec.schedule.pricing),
   from which the scheduler's cost model is built: only for num_draft "auto" with a drafter.

edgespec.load, `edgespec generate/chat/serve/bench/profile` come through here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from edgespec.drafters.base import Drafter
from edgespec.drafters.heads import HeadImpl
from edgespec.drafters.registry import (
    DrafterPlan,
    check_backend,
    open_backend,
    open_drafter,
    plan_drafter,
    plan_model,
)
from edgespec.engine import Engine
from edgespec.schedule.scheduler import K_MAX, check_num_draft
from edgespec.tree_step import check_tree

Spec = str | os.PathLike[str]


@dataclass(frozen=True)
class Options:
    """How backends open (both the target and a draft model)."""

    n_ctx: int = 4096
    threads: int | None = None
    n_gpu_layers: int = 0
    verbose: bool = False


@dataclass(frozen=True)
class Plan:
    """What to open: resolved files and drafter plans, checked against each other."""

    target: Path  # the GGUF file (on "mlx" also an mlx-lm directory)
    backend: str
    drafters: tuple[DrafterPlan, ...]  # none: plain decoding
    options: Options = Options()
    num_draft: int | str = "auto"
    tree: int | str = 0  # N: draft trees of up to N nodes every cycle, "auto": priced each cycle (tree_step); 0: chains

    @property
    def layers(self) -> tuple[int, ...] | None:
        """The target layers the first feature head reads (None: no head, a plain target)."""
        return next((m.head.layers for d in self.drafters for m in d.parts if m.head is not None), None)

    @property
    def mtp(self) -> bool:
        """Whether a drafter reads the target's MTP layers or hidden rows (the target opens with them:
        drafters.mtp, drafters.assistant)."""
        return any(m.kind in ("mtp", "assistant") for d in self.drafters for m in d.parts)

    @property
    def hidden(self) -> bool:
        """Whether a drafter reads the target's final-norm hidden states (drafters.medusa)."""
        return any(m.kind == "medusa" for d in self.drafters for m in d.parts)


def plan(target: Spec | None = None, drafters: Spec | Sequence[Spec] | None = (), backend: str = "llama.cpp", *,
         num_draft: int | str = "auto", tree: int | str = "off", **options: Any) -> Plan:
    """Phase 1: resolve and check every file named, open nothing.

    Args:
        target: GGUF path or known model name (on "mlx" also an mlx-lm directory); None: the default.
        drafters: a drafter spec or several (bench); None / "none" for none (drafters.registry).
        backend: "llama.cpp" or "mlx".
        num_draft: γ, or "auto".
        tree: "off"; "auto": a tree or the chain, priced every cycle under num_draft "auto"
            (schedule.trees); or N: draft trees of up to N nodes (and depth γ) every cycle, forced,
            which needs a fixed γ.
        **options: Options' fields (n_ctx, threads, n_gpu_layers, verbose).
    """
    from edgespec.models import DEFAULT_TARGET, resolve_model

    check_backend(backend)
    gamma = check_num_draft(num_draft)
    nodes = check_tree(tree, gamma)
    path = plan_model(resolve_model(str(target or DEFAULT_TARGET)), backend)
    if drafters is None or isinstance(drafters, (str, os.PathLike)):
        drafters = [drafters]
    planned = []
    for spec in drafters:
        drafter = plan_drafter(spec, path, backend)
        if drafter is not None:  # "none"
            planned.append(drafter)
    return Plan(path, backend, tuple(planned), Options(**options), gamma, nodes)


class Session:
    """Phase 2: a Plan opened. `engine` runs the first drafter; `use` switches to another.

    Args:
        plan: from `plan`.
        impl: where a feature head runs (drafters.heads.open_head).
    """

    def __init__(self, plan: Plan, *, impl: HeadImpl = "auto") -> None:
        self.plan = plan
        self._plain: Engine | None = None
        self.drafters: dict[str, Drafter] = {}
        opts = asdict(plan.options)
        leaves = {"tree_leaves": K_MAX - 1 if plan.tree == "auto" else plan.tree} \
            if plan.tree and plan.drafters and plan.backend == "llama.cpp" else {}
        with ExitStack() as opened:  # a failure closes what was opened before it
            target = opened.enter_context(open_backend(plan.target, plan.backend, plan.layers, mtp=plan.mtp,
                                                       hidden=plan.hidden, **opts, **leaves))
            for d in plan.drafters:
                drafter = self.drafters[d.spec] = open_drafter(d, target, plan.backend, impl=impl, **opts)
                opened.callback(drafter.close)
            first = next(iter(self.drafters.values()), None)
            self.engine = Engine(target, first, num_draft=plan.num_draft, tree=plan.tree)
            opened.pop_all()

    def price(self, note: Callable[[str], None] | None = None) -> None:
        """Phase 3: load (or time, and cache per model) what the target and each drafter cost, which
        the scheduler starts from; `note` hears of any timing. The first auto generation would do it."""
        current = self.engine.drafter
        for d in self.drafters.values():
            if d is not None:
                self.engine.drafter = d
                self.engine.calibrate(note=note)
        self.engine.drafter = current

    def plain_engine(self) -> Engine:
        """An engine for plain decoding on the same file: the session's own, unless its target
        captures features for a head or MTP rows (a plain baseline must not pay for that)."""
        if self.plan.layers is None and not self.plan.mtp and not self.plan.hidden:
            return self.engine
        if self._plain is None:
            self._plain = Engine(open_backend(self.plan.target, self.plan.backend, **asdict(self.plan.options)))
        return self._plain

    def close(self) -> None:
        """Close every drafter, the target and the plain engine's target (if one was opened)."""
        self.engine.stop_timing()  # an idle timing run may be timing a drafter
        self.engine.drafter = None
        for d in self.drafters.values():
            d.close()
        self.engine.close()
        if self._plain is not None:
            self._plain.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load(target: Spec | None = None, drafter: Spec | None = "ngram", *, backend: str = "llama.cpp",
         num_draft: int | str = "auto", note: Callable[[str], None] | None = None, price: bool = False,
         learn: bool = False, **options: Any) -> Engine:
    """plan → open → (price): one Engine that owns its target and drafter (close it when done).

    `price` prices at once when num_draft is "auto" and there is a drafter (`note` hears of timing),
    unless `learn` and the target has no cached cost profile (`price_engine`); else the first auto
    generation does. Other arguments: as for `plan`.
    """
    planned = plan(target, drafter, backend, num_draft=num_draft, **options)
    engine = Session(planned).engine
    try:
        if price:
            price_engine(engine, note, learn=learn)
    except BaseException:
        engine.close()
        raise
    return engine


def price_engine(engine: Engine, note: Callable[[str], None] | None = None, learn: bool = False,
                 background: bool = False) -> None:
    """Price an engine now, not at its first auto generation: only when num_draft is "auto" and it has
    a drafter (cached per model; `note` hears of timing). `load(price=True)` and `serve` call it.
    `learn`: a target with no cached cost profile is not timed now: `note` hears one line, and its
    first auto reply decodes plainly while its costs are learned (edgespec.schedule.first_use);
    `background`: timed from now on while the engine is idle, too (`Engine.calibrate`)."""
    if engine.num_draft != "auto" or engine.drafter is None:
        return
    if learn and engine.pricing.unknown():
        if note:
            note(f"no cost profile for {Path(engine.target.path).name} on this machine yet: replies decode "
                 "plainly until its costs are learned, from the first reply and while idle (once per model)")
        if background:
            engine.calibrate(background=True)
        return
    engine.calibrate(note=note)
