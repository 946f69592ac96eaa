"""`edgespec profile`: measure T(k), a drafter's cost and acceptance, and print the ideal speedups."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from edgespec.cli import ui


def profile(
    model: Annotated[str, typer.Option("--model", "-m", help="Target: GGUF path or known model name.")] = "smollm2",
    drafter: Annotated[str, typer.Option(
        "--drafter", help="Drafter to cost and to measure acceptance with ('ngram', a draft GGUF, a head "
                         "GGUF (EAGLE-3, DFlash, DSpark), or 'none').")] = "ngram",
    max_k: Annotated[int, typer.Option("--max-k", min=2, max=64, help="Time forwards of 1..K tokens.")] = 16,
    repeats: Annotated[int, typer.Option("--repeats", "-r", min=1, help="Alternating repeats (medians).")] = 5,
    threads: Annotated[int | None, typer.Option("--threads", min=1, help="CPU threads.")] = None,
    refresh: Annotated[bool, typer.Option("--refresh", help="Re-measure T(k) even if cached.")] = False,
    plot: Annotated[str | None, typer.Option("--plot", help="Write a PNG of T(k)/T(1) (needs matplotlib).")] = None,
) -> None:
    """Measure T(k), a drafter's cost and acceptance, ideal speedups.

    Measures the target's forward time T(k) with logits for all k rows (what
    verification pays), the drafter's cost, its acceptance on one bench task
    per category (greedy, γ = K−1), and the ideal speedup E[τ(γ)]·T(1) /
    (T_draft(γ) + T(γ+1)) for each γ, taken over the recorded cycles
    truncated to γ (a drafter that proposes fewer tokens pays a shorter
    verification). T(k) is cached per model, threads and version.
    """
    from edgespec.backends.llama_cpp import default_threads
    from edgespec.bench.profile import expected_tau, ideal_speedup_at
    from edgespec.session import Session, plan

    threads = threads or default_threads()
    p = plan(model, drafter, threads=threads, n_ctx=2048)
    with Session(p) as session:
        engine = session.engine
        plain = session.plain_engine().target  # T(k) is the plain target's, not a head's feature-capturing one
        prof, version = _target_costs(plain, max_k, repeats, refresh), _version(plain)
        gammas = [g for g in range(0, max_k) if g + 1 in prof.t_forward_ms]
        rows_tau, ideal, mean_draft = {0: 1.0}, {0: 1.0}, {0: 0.0}
        if engine.drafter is not None:
            _draft_cost(prof, engine.drafter)
            cycles = _acceptance(engine, max(gammas))
            drafted, accepted = [d for d, _ in cycles], [a for _, a in cycles]
            rows_tau.update({g: expected_tau(accepted, drafted, g) for g in gammas if g > 0})
            ideal.update({g: ideal_speedup_at(prof.t_forward_ms, prof.t_draft, cycles, g) for g in gammas if g > 0})
            mean_draft.update({g: sum(min(d, g) for d in drafted) / max(1, len(drafted)) for g in gammas})
        t1 = prof.t_forward_ms[1]
        ui.print_table(
            ["γ", "T(γ+1) ms", "T(γ+1)/T(1)", "T_draft(γ) ms", "mean drafted", "E[τ(γ)]", "ideal speedup"],
            [[g, f"{prof.t_forward_ms[g + 1]:.1f}", f"{prof.t_forward_ms[g + 1] / t1:.2f}", f"{prof.t_draft(g):.2f}",
              f"{mean_draft[g]:.2f}" if g in mean_draft else "–", f"{rows_tau[g]:.2f}" if g in rows_tau else "–",
              f"{ideal[g]:.2f}×" if ideal.get(g) else "–"] for g in gammas],
            title=f"{p.target} · {engine.target.name} {version} · {threads} threads · drafter "
                  f"{prof.draft_kind or 'none'}")
    if plot:
        _plot(prof, plot)
        ui.status(f"wrote {plot}")


def _version(target) -> str:
    from edgespec.calibration import backend_version

    return backend_version(target)


def _target_costs(target, max_k: int, repeats: int, refresh: bool):
    """The target's cost profile with T(1..max_k) and the context term, measured unless cached."""
    from edgespec.calibration import context_cost, load_profile, profile_path, save_profile, time_forward

    cached = profile_path(target)
    assert cached is not None
    prof = None if refresh else load_profile(cached)
    if prof is not None and all(k in prof.t_forward_ms for k in range(1, max_k + 1)):
        ui.status(f"T(k) from the cache {cached} (--refresh to re-measure)")
    else:
        ks = list(range(1, max_k + 1))
        with ui.progress(f"timing T(1..{max_k})", repeats) as advance:
            t = time_forward(target, ks, repeats, progress=lambda done, _: advance(done))
        save_profile(cached, target, t_forward_ms=t)  # keeps the other fields (exact_batch)
        prof = None
    if prof is None or prof.context_ms is None:
        ui.status("timing what each cached token adds: T(16) after 64 and after 832 cached tokens")
        context_cost(target, far=768, repeats=max(3, repeats), refresh=True)
        prof = load_profile(cached)
        assert prof is not None
        ui.status(f"saved {cached}")
    ui.status(f"each cached token adds {1000 * (prof.context_ms or 0.0):.2f} µs to every verified token "
              "(attention; the scheduler adds it to T(k) for the context at hand)")
    return prof


def _draft_cost(prof, drafter) -> None:
    """Put the drafter's cost prior in `prof` (a draft model's own T(1) per token, a head's chain
    step or block), and say what it is against the target's T(1)."""
    prof.draft_kind = drafter.name
    cost = drafter.cost_prior(note=ui.status)
    if cost is None:
        return
    prof.draft_fixed_ms, prof.draft_per_token_ms = cost.fixed_ms, cost.per_token_ms
    t1 = prof.t_forward_ms[1]
    if cost.block and cost.max_block is not None:
        n = cost.max_block
        ui.status(f"{prof.draft_kind}: a block of {n} drafts costs {prof.t_draft(n):.2f} ms = "
                  f"{prof.t_draft(n) / t1:.1%} of the target's T(1) ({cost.fixed_ms:.2f} ms fixed + "
                  f"{cost.per_token_ms:.3f} ms per row)")
    else:
        ui.status(f"{prof.draft_kind}: {cost.per_token_ms:.2f} ms per drafted token = "
                  f"{cost.per_token_ms / t1:.1%} of the target's T(1)")


def _acceptance(engine, gamma: int) -> list[tuple[int, int]]:
    """(drafted, accepted) per cycle, greedy at γ on the first bench task of each category."""
    from edgespec.bench.tasks import load_tasks

    tasks = list({t.category: t for t in reversed(load_tasks())}.values())  # the first of each category
    chat = engine.target.metadata("tokenizer.chat_template") is not None
    cycles = []
    with ui.progress(f"acceptance at γ={gamma} on {len(tasks)} tasks", len(tasks)) as advance:
        for i, task in enumerate(tasks):
            kw = dict(max_tokens=min(task.max_tokens, 96), num_draft=gamma)
            g = engine.chat(list(task.messages), **kw) if chat else engine.generate(task.prompt, **kw)
            cycles += g.stats.cycles
            advance(i + 1)
    return cycles


def _plot(prof, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        from edgespec.errors import MissingDependencyError

        raise MissingDependencyError("--plot needs matplotlib: pip install 'edgespec[plot]'") from e
    ks = sorted(prof.t_forward_ms)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(ks, [prof.t_forward_ms[k] / prof.t_forward_ms[1] for k in ks], marker="o", label="T(k)/T(1)")
    ax.plot(ks, ks, linestyle=":", color="grey", label="k (no batching gain)")
    ax.set_xlabel("tokens per forward (k)")
    ax.set_ylabel("T(k) / T(1)")
    ax.set_title(f"{Path(prof.model).name} · {prof.threads} threads", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

