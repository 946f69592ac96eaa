"""`edgespec bench`: plain vs speculative configs per task category, alternating; tables and plots."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer

from edgespec.cli import ui
from edgespec.errors import EdgespecError

SUITES = ("shipped", "spec-bench", "edit-session", "agent-loop")  # the last two: bench.sessions.SUITES


# the options whose help needs more than a line
_Target = Annotated[str, typer.Option("--target", help="Target: GGUF path or known model name (with --backend mlx "
                                      "also an mlx-lm directory).")]
_Drafters = Annotated[list[str] | None, typer.Option(
    "--drafter", help="Drafter config (repeatable): 'ngram' (or 'ngram:N_MAX:N_MIN', the n-gram sizes), 'history', a "
                      "same-vocabulary GGUF path/name, an EAGLE-3 / DFlash / DSpark head GGUF, or a comma chain of these (e.g. ngram,smollm2).")]
_Gammas = Annotated[list[str] | None, typer.Option(
    "-k", "--num-draft", help="γ values (repeatable): integers >= 1, 'auto' for the scheduler, or 0: plain decoding "
                              "paired with plain decoding (an A/A control: its ratio spread is the machine's noise; "
                              "with a head, the cost of capturing features) (default: 4 and auto).")]
_Temps = Annotated[list[float] | None, typer.Option(
    "--temp", min=0.0, help="Temperatures (repeatable; 0 = greedy, which also checks spec == plain).")]
_Tasks = Annotated[str | None, typer.Option("--tasks", help="Your own tasks: a .jsonl file or folder, instead of a "
                                            "--suite.")]
_Suite = Annotated[str | None, typer.Option(
    "--suite", help="A built-in task suite: 'shipped' (edgespec/bench/suite, the default), 'spec-bench' "
                    "(Spec-Bench's 480 prompts: multi_turn, translation, summarization, qa, math_reasoning, rag), "
                    "or a session suite, each turn sent to one engine in order (the drafter cleared at each "
                    "session's start only): 'edit-session' (a file edited turn after turn) or 'agent-loop' "
                    "(tool calls, BFCL). Not with --tasks.")]
_PerCategory = Annotated[int, typer.Option("--per-category", min=1, help="Tasks per category (spec-bench: spread "
                                           "evenly over each category's 80; session suites: sessions).")]
_Out = Annotated[Path, typer.Option("--out", "-o", help="Folder for results.json, results.md, PNGs.")]
_Strict = Annotated[bool, typer.Option("--strict/--no-strict", help="Exit 1 if a greedy speculative run differs "
                                       "from plain decoding.")]


def bench(
    target: _Target = "smollm2",
    drafter: _Drafters = None,
    k: _Gammas = None,
    temp: _Temps = None,
    tasks: _Tasks = None,
    suite: _Suite = None,
    category: Annotated[list[str] | None, typer.Option("--category", help="Only these categories (repeatable).")] = None,
    per_category: _PerCategory = 3,
    max_tokens: Annotated[int | None, typer.Option("--max-tokens", min=1, help="Cap each task's tokens.")] = None,
    repeats: Annotated[int, typer.Option("--repeats", "-r", min=1, help="Plain/spec pairs per task and config.")] = 1,
    backend: Annotated[str, typer.Option("--backend", help="Runtime: 'llama.cpp' or 'mlx'.")] = "llama.cpp",
    threads: Annotated[int | None, typer.Option("--threads", min=1, help="CPU threads (default: up to 8).")] = None,
    ctx: Annotated[int, typer.Option("--ctx", min=64, help="Context size in tokens.")] = 2048,
    out: _Out = Path("out/bench"),
    strict: _Strict = True,
) -> None:
    """Benchmark plain vs speculative decoding on the task suite.

    Plain decoding vs each speculative config on the task suite (--suite
    shipped, spec-bench, edit-session or agent-loop, or your own --tasks),
    alternating in one process on the same backend; per config and
    category: tok/s, speedup min/median/max, τ, acceptance by position,
    time split, peak RSS, greedy mismatches, and efficiency vs the ideal
    speedup from `edgespec profile`. Session suites: by turn too.
    """
    from edgespec.backends.llama_cpp import default_threads
    from edgespec.bench.run import Config
    from edgespec.schedule.scheduler import check_num_draft
    from edgespec.session import Session, plan

    threads = threads or default_threads()
    selected = _select(suite, tasks, category, per_category, max_tokens)
    gammas = [check_num_draft(g) for g in (k or ["4", "auto"])]
    configs = [Config(d, g) for d in (drafter or ["ngram"]) for g in gammas]
    temps = temp or [0.0]
    # a head drafts from target features: speculative runs use a target that captures them, plain runs a
    # plain backend of the same file (Session.plain_engine), so plain tok/s does not pay for the capture
    with Session(plan(target, [c.drafter for c in configs], backend, threads=threads, n_ctx=ctx)) as session:
        if "auto" in gammas:
            session.price(note=ui.status)  # the scheduler's cost prior (cached profiles)
        runs, interrupted, mismatches = _run(session, configs, selected, temps, repeats)
        meta = dict(command=" ".join(["edgespec", *map(shlex.quote, sys.argv[1:])]),
                    target=session.engine.target.path, threads=threads, configs=[c.label for c in configs],
                    temperatures=temps, repeats=repeats, tasks=[t.id for t in selected],
                    interrupted_after=len(runs) if interrupted else None)
        _report(session, configs, runs, meta, out, f"edgespec profile --model {target} --threads {threads}")
    if mismatches:
        ui.print_error(f"{len(mismatches)} greedy run(s) differ from plain decoding: {', '.join(mismatches[:5])}")
        if strict:
            raise typer.Exit(1)
    if interrupted:
        raise typer.Exit(130)


def _select(suite: str | None, tasks: str | None, category: list[str] | None, per_category: int,
            max_tokens: int | None) -> list:
    """The tasks (or sessions) to run: per category at most `per_category`, each turn capped at `max_tokens`."""
    from edgespec.bench.sessions import SUITES as SESSION_SUITES
    from edgespec.bench.sessions import cap_tokens, load_sessions
    from edgespec.bench.tasks import first_per_category

    if suite is not None and suite not in SUITES:
        raise EdgespecError(f"--suite is {suite!r}: expected one of {', '.join(SUITES)}")
    if suite is not None and tasks is not None:
        raise EdgespecError("--suite and --tasks are mutually exclusive: --tasks runs your own task file(s), "
                            "--suite a built-in suite")

    if suite == "spec-bench":
        from edgespec.bench.spec_bench import load_spec_bench

        chosen = load_spec_bench(category, per_category)  # already per_category, spread over each category
    elif suite in SESSION_SUITES:
        chosen = load_sessions(suite, category)
    else:
        from edgespec.bench.tasks import load_tasks

        chosen = load_tasks(tasks, category)
    return [cap_tokens(t, max_tokens) for t in first_per_category(chosen, per_category)]


def _run(session, configs: list, selected: list, temps: list[float], repeats: int) -> tuple[list, bool, list[str]]:
    """Every run (plain and speculative alternating), whether Ctrl-C cut it short, the greedy mismatches."""
    from edgespec.bench.run import run_matrix
    from edgespec.bench.sessions import as_session

    engine = session.engine
    chat = engine.target.metadata("tokenizer.chat_template") is not None
    turns = sum(len(as_session(t).turns) for t in selected)
    total = turns * len(temps) * repeats * len(configs) * 2
    what = f"{len(selected)} tasks" if turns == len(selected) else f"{len(selected)} sessions ({turns} turns)"
    ui.status(f"{what} × {len(temps)} temperature(s) × {repeats} repeat(s) × {len(configs)} "
              f"config(s), each paired with a plain run: {total} generations "
              f"({'chat template' if chat else 'plain prompts'})")
    runs, mismatches = [], []

    def on_run(r) -> None:
        runs.append(r)
        advance(len(runs))
        if r.matches_plain is False:
            mismatches.append(f"{r.task} {r.config}")
            ui.print_error(f"greedy mismatch: {r.task} with {r.config} differs from plain decoding")

    try:
        with ui.progress("bench", total) as advance:
            drafters = {c.drafter: session.drafters.get(c.drafter) for c in configs}  # "none": None
            run_matrix(engine, drafters, configs, selected, temps, repeats, chat, on_run, session.plain_engine())
    except KeyboardInterrupt:  # keep what was measured: write the report of the runs so far
        ui.interrupted()
        runs = runs[: len(runs) - len(runs) % 2]  # whole plain/spec pairs only
        if not runs:
            raise typer.Exit(130) from None
        return runs, True, mismatches
    return runs, False, mismatches


def _report(session, configs: list, runs: list, meta: dict, out: Path, profile_cmd: str) -> None:
    """results.json, results.md, the plots, and the all-categories table on the terminal."""
    from edgespec.bench import report
    from edgespec.bench.run import by_turn, environment, runs_as_dicts, summarize
    from edgespec.calibration import profile_path
    from edgespec.models import model_sha256

    def sha256(path: str) -> str:
        return model_sha256(path) if Path(path).is_file() else "(an MLX directory)"

    target = session.engine.target
    sha = {target.path: sha256(target.path)}
    draft_cost = {}  # config label -> the drafter's cost prior (a draft model's own T(1) per token)
    for name, d in session.drafters.items():
        if d is None:
            continue
        sha.update({p: sha256(p) for p in d.paths})
        if (cost := d.cost_prior(note=ui.status)) is not None:
            draft_cost.update({c.label: cost for c in configs if c.drafter == name})
    t_fwd = _cached_profile(profile_path(target))
    if t_fwd is None:
        ui.status(f"no cost profile for this target/threads: run `{profile_cmd}` to get efficiency figures")
    summary, turns = summarize(runs, t_fwd, draft_cost), by_turn(runs)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(meta, env=environment(), sha256=sha)
    report.write_json(out / "results.json", meta, summary, runs_as_dicts(runs), turns)
    pngs = report.plots(out, summary)
    (out / "results.md").write_text(report.markdown(meta, summary, pngs, turns))
    ui.print_table(["config", "temp", "plain tok/s", "spec tok/s", "speedup (min / med / max)", "τ",
                    "wasted verify / token", "mismatches"],
                   [[r["config"], f"{r['temperature']:g}", f"{r['plain_tok_per_s']:.1f}", f"{r['tok_per_s']:.1f}",
                     f"{r['speedup_min']:.2f} / {r['speedup_median']:.2f} / {r['speedup_max']:.2f}",
                     f"{r['tau']:.2f}", f"{r['wasted_per_token']:.2f}", r["mismatches"]]
                    for r in summary if r["category"] == "all"],
                   title="all categories (per-category tables in results.md)")
    ui.status(f"wrote {out / 'results.md'}, results.json" + (f", {', '.join(pngs)}" if pngs else ""))


def _cached_profile(path: Path | None) -> dict[int, float] | None:
    from edgespec.calibration import load_profile

    prof = load_profile(path)
    return prof.t_forward_ms if prof else None
