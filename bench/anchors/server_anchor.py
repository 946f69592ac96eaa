"""Anchor: llama-server's own n-gram speculation against `edgespec serve`, on the same requests.

The same fixed request sequence (a session suite, turn after turn, or Spec-Bench questions) is
sent through the official `openai` client to a series of servers, ONE AT A TIME, each a fresh
process on 127.0.0.1 with a free port and the same target GGUF, threads, context and greedy
sampling:

    llama:plain                 llama-server, no speculation
    llama:TYPE                  llama-server --spec-type TYPE (default: ngram-mod, ngram-map-k, ngram-cache)
    edgespec:plain              edgespec serve --no-spec
    edgespec:history            edgespec serve --drafter history -k auto --history global
    edgespec:ngram              edgespec serve --drafter ngram -k auto   (--edgespec-ngram)

Each request's measurement is the server's own `timings` object (both return llama-server's on a
non-streamed chat completion): predicted_per_second, predicted_n, draft_n, draft_n_accepted.
Servers run in an alternating order over --rounds (round 1 in the order above, round 2 reversed,
...), and the summary takes medians per (config, suite, category) of the decode tok/s and of the
ratios paired by request and round: speedup over the same implementation's plain server, and
edgespec's ÷ the best llama-server n-gram type's. Build llama-server first:
`bench/anchors/build.sh llama-server`. bench/anchors/README.md describes the rules.

    .venv/bin/python bench/anchors/server_anchor.py --target ~/.cache/edgespec/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --suite edit-session [--suite agent-loop] [--rounds 2] --out out/server-anchor.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
for _p in (REPO, Path(__file__).resolve().parent):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from server_procs import (  # noqa: E402
    BIN_NAME,
    AnchorError,
    Server,
    ask,
    environment,
    find_edgespec,
    find_llama_server,
    free_port,
    log,
    resolve_target,
    run_text,
)
from server_report import EDGESPEC, LLAMA, PLAIN, markdown, summarise, text_mismatches  # noqa: E402

SUITES = ("edit-session", "agent-loop", "spec-bench")
DEFAULT_SPEC_TYPES = ("ngram-mod", "ngram-map-k", "ngram-cache")


# -- arguments --------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="server_anchor.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True,
                   help="target GGUF: a path, a file name in $EDGESPEC_HOME/models, or an edgespec model name")
    p.add_argument("--suite", action="append", choices=SUITES,
                   help="request sequence (repeatable; default edit-session and agent-loop)")
    p.add_argument("--spec-type", action="append", metavar="'TYPE [FLAGS...]'",
                   help="a llama-server speculative config (repeatable; default: "
                        f"{', '.join(DEFAULT_SPEC_TYPES)}): its --spec-type, then optional extra llama-server "
                        "flags, e.g. 'ngram-mod --spec-ngram-mod-n-min 8'. Types this llama-server does "
                        "not list are skipped with a warning")
    p.add_argument("--edgespec-ngram", action="store_true", help="also run edgespec serve --drafter ngram -k auto")
    p.add_argument("--no-edgespec", action="store_true", help="run only the llama-server configs")
    p.add_argument("--no-llama", action="store_true", help="run only the edgespec configs")
    p.add_argument("--only", action="append", metavar="CONFIG",
                   help="run only these configs (repeatable; e.g. llama:plain, llama:ngram-mod, edgespec:history)")
    p.add_argument("--rounds", type=int, default=2, help="rounds over every config (alternating order; default 2)")
    p.add_argument("--max-sessions", type=int, default=None, help="first N sessions of each suite")
    p.add_argument("--max-tokens-cap", type=int, default=None, help="cap every request's max_tokens at N")
    p.add_argument("--per-category", type=int, default=2, help="Spec-Bench questions per category (default 2)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of every server (default 2)")
    p.add_argument("--ctx", type=int, default=4096, help="context size of every server (default 4096)")
    p.add_argument("--batch", type=int, default=512,
                   help="llama-server -b/-ub (default 512: edgespec's n_batch = n_ubatch)")
    p.add_argument("--kv-type", default="q8_0", help="llama-server -ctk/-ctv (default q8_0, what edgespec's "
                                                     "kv_type auto picks for these models)")
    p.add_argument("--native-defaults", action="store_true",
                   help="llama-server without edgespec's context settings (--no-repack, -ctk/-ctv, --swa-full, -b/-ub)")
    p.add_argument("--bin", help=f"{BIN_NAME} binary (default: $EDGESPEC_LLAMA_SERVER_BIN, else "
                                 "$EDGESPEC_HOME/anchors/build-*/bin/llama-server)")
    p.add_argument("--edgespec-bin", help="edgespec command (default: the repository's .venv/bin/edgespec)")
    p.add_argument("--start-timeout", type=float, default=600.0,
                   help="seconds a server may take to answer /health (edgespec -k auto may measure costs first)")
    p.add_argument("--request-timeout", type=float, default=900.0, help="seconds per request")
    p.add_argument("--log-dir", help="keep every server's log here (default: a temporary dir, removed)")
    p.add_argument("--out", help="JSON output (environment, commands, per-request records, summary)")
    args = p.parse_args(argv)
    args.suite = list(dict.fromkeys(args.suite or ["edit-session", "agent-loop"]))
    args.spec_type = list(dict.fromkeys(args.spec_type or DEFAULT_SPEC_TYPES))
    for name, value, low in (("--rounds", args.rounds, 1), ("--max-sessions", args.max_sessions, 1),
                             ("--max-tokens-cap", args.max_tokens_cap, 1), ("--per-category", args.per_category, 1),
                             ("--threads", args.threads, 1), ("--ctx", args.ctx, 256), ("--batch", args.batch, 1)):
        if value is not None and value < low:
            p.error(f"{name} must be >= {low} (got {value})")
    if args.no_edgespec and args.no_llama:
        p.error("--no-edgespec and --no-llama leave nothing to run")
    for spec in args.spec_type:
        try:
            parse_spec_type(spec)
        except ValueError as e:
            p.error(str(e))
    return args


def parse_spec_type(spec: str) -> tuple[str, str, list[str]]:
    """'TYPE [FLAGS...]' -> (config name, type, extra flags). The name is 'llama:TYPE', with the flags
    appended when there are any ('llama:ngram-mod --spec-ngram-mod-n-min 8')."""
    parts = shlex.split(spec)
    if not parts or not re.fullmatch(r"[a-z0-9][a-z0-9-]*", parts[0]):
        raise ValueError(f"--spec-type must start with a type name such as ngram-mod (got {spec!r})")
    if parts[0] == "none":
        raise ValueError("--spec-type none is llama:plain, which always runs")
    name = "llama:" + " ".join([parts[0], *parts[1:]])
    return name, parts[0], parts[1:]


def supported_spec_types(help_text: str) -> set[str]:
    """The --spec-type values `llama-server --help` lists ('--spec-type none,draft-simple,...' or the
    '[a|b|c]' form of the docs); empty when it lists none."""
    m = re.search(r"--spec-type\s+\[?([a-z0-9][a-z0-9,|\-]*)\]?", help_text)
    return {t for t in re.split(r"[,|]", m.group(1)) if t} if m else set()


# -- request sequences ------------------------------------------------------------------------------


def _cap(max_tokens: int, cap: int | None) -> int:
    return max_tokens if cap is None else min(max_tokens, cap)


def load_suite(suite: str, max_sessions: int | None = None, max_tokens_cap: int | None = None,
               per_category: int = 2, path: str | Path | None = None) -> list[dict[str, Any]]:
    """One suite's request sequence: sessions in file order, each {"id", "category", "turns": [{"messages",
    "max_tokens"}]}, the first `max_sessions`, every max_tokens capped. Spec-Bench: each question is a
    session of one turn (`per_category` per category, spread as `edgespec bench --suite spec-bench` does).
    `path` reads a session JSONL file instead of the vendored suite."""
    if suite not in SUITES:
        raise AnchorError(f"unknown suite {suite!r} (known: {', '.join(SUITES)})")
    if suite == "spec-bench" and path is None:
        from edgespec.bench.spec_bench import load_spec_bench
        sessions = [{"id": t.id, "category": t.category,
                     "turns": [{"messages": [dict(m) for m in t.messages], "max_tokens": t.max_tokens}]}
                    for t in load_spec_bench(per_category=per_category)]
    else:
        from edgespec.bench.sessions import load_sessions
        try:
            sessions = [{"id": x.id, "category": x.category,
                         "turns": [{"messages": [dict(m) for m in t.messages], "max_tokens": t.max_tokens}
                                   for t in x.turns]}
                        for x in load_sessions(suite if path is None else Path(path))]
        except Exception as e:  # noqa: BLE001 - the loader's one-line error (EdgespecError)
            raise AnchorError(f"{suite}: {e}") from None
    if max_sessions is not None:
        sessions = sessions[:max_sessions]
    return [{**s, "turns": [{**t, "max_tokens": _cap(t["max_tokens"], max_tokens_cap)} for t in s["turns"]]}
            for s in sessions]


def requests_of(sessions: Sequence[dict[str, Any]]) -> list[tuple[str, str, dict[str, Any]]]:
    """(request id 'SESSION/tK', category, turn) in the order they are sent."""
    return [(f"{s['id']}/t{k}", s["category"], t) for s in sessions for k, t in enumerate(s["turns"], 1)]


# -- configs and commands ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    name: str           # llama:plain, llama:ngram-mod, edgespec:history, ...
    impl: str           # LLAMA or EDGESPEC
    spec: bool          # speculates (False: the implementation's plain baseline)
    flags: tuple[str, ...] = ()   # what this config adds to its implementation's common flags


def make_configs(args: argparse.Namespace, supported: set[str] | None) -> tuple[list[Config], list[str]]:
    """The configs to run in round-1 order, and warnings for --spec-type values left out."""
    configs: list[Config] = []
    skipped: list[str] = []
    if not args.no_llama:
        configs.append(Config(PLAIN[LLAMA], LLAMA, False))
        for spec in args.spec_type:
            name, kind, extra = parse_spec_type(spec)
            if supported is not None and kind not in supported:
                skipped.append(f"{name}: this llama-server does not list --spec-type {kind} "
                               f"(it lists: {', '.join(sorted(supported)) or 'nothing'})")
                continue
            configs.append(Config(name, LLAMA, True, ("--spec-type", kind, *extra)))
    if not args.no_edgespec:
        configs.append(Config(PLAIN[EDGESPEC], EDGESPEC, False, ("--no-spec",)))
        configs.append(Config("edgespec:history", EDGESPEC, True, ("--drafter", "history", "-k", "auto")))
        if args.edgespec_ngram:
            configs.append(Config("edgespec:ngram", EDGESPEC, True, ("--drafter", "ngram", "-k", "auto")))
    if args.only:
        known = {c.name for c in configs}
        unknown = [o for o in args.only if o not in known]
        if unknown:
            raise AnchorError(f"--only {', '.join(unknown)}: no such config (configs: {', '.join(sorted(known))})")
        configs = [c for c in configs if c.name in args.only]
    return configs, skipped


def round_order(configs: Sequence[Config], round_index: int) -> list[Config]:
    """Round 0 (the first) in the given order, round 1 reversed, and so on alternately."""
    return list(configs) if round_index % 2 == 0 else list(reversed(configs))


def command(cfg: Config, args: argparse.Namespace, target: str, port: int, llama_bin: str | None,
            edgespec_cmd: Sequence[str]) -> list[str]:
    """The exact command line of one server."""
    t = str(args.threads)
    if cfg.impl == LLAMA:
        if llama_bin is None:
            raise AnchorError("no llama-server binary")
        cmd = [llama_bin, "-m", target, "--host", "127.0.0.1", "--port", str(port), "-c", str(args.ctx),
               "-t", t, "-tb", t, "-np", "1"]
        if not args.native_defaults:
            # what edgespec's LlamaCppBackend sets: n_batch = n_ubatch, no weight repacking, Q8_0 KV
            # cache, a full SWA cache
            cmd += ["-b", str(args.batch), "-ub", str(args.batch), "--no-repack",
                    "-ctk", args.kv_type, "-ctv", args.kv_type, "--swa-full"]
        return cmd + list(cfg.flags)
    return [*edgespec_cmd, "serve", "--target", target, "--host", "127.0.0.1", "--port", str(port),
            "--threads", t, "--ctx", str(args.ctx), "--temp", "0", "--history", "global", *cfg.flags]


# -- records and summary ----------------------------------------------------------------------------


def decode_passes(impl: str, predicted_n: int, accepted: int) -> int:
    """Target passes that produced the predicted tokens, the prompt's excluded. llama-server's first token
    comes from the prompt pass (its timings leave it out of predicted_ms and predicted_per_second);
    edgespec's prefill stops one token short, so its first cycle makes the first token."""
    n = predicted_n - 1 if impl == LLAMA else predicted_n
    return max(n - accepted, 0)


def record(cfg: Config, suite: str, round_index: int, request: str, category: str, max_tokens: int,
           resp: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """One request's row from a chat.completion response (its `timings`, usage, text)."""
    tm = resp.get("timings") or {}
    choice = (resp.get("choices") or [{}])[0]
    text = (choice.get("message") or {}).get("content") or ""
    n = int(tm.get("predicted_n", 0) or 0)
    draft_n = tm.get("draft_n")
    accepted = tm.get("draft_n_accepted")
    if cfg.spec and tm and draft_n is None:
        draft_n = accepted = 0  # llama-server leaves draft_n out when nothing was drafted
    tau: float | None = None
    tau_source = None
    if isinstance(tm.get("tau"), (int, float)) and tm["tau"] > 0:
        tau, tau_source = float(tm["tau"]), "server"
    elif draft_n is not None and accepted is not None:
        passes = decode_passes(cfg.impl, n, int(accepted))
        if passes > 0:
            tau, tau_source = (n - 1 if cfg.impl == LLAMA else n) / passes, "derived"
    elif not cfg.spec and n > 0:
        tau, tau_source = 1.0, "plain"
    return {
        "round": round_index + 1, "suite": suite, "config": cfg.name, "impl": cfg.impl, "spec": cfg.spec,
        "request": request, "category": category, "max_tokens": max_tokens,
        "predicted_n": n, "predicted_ms": tm.get("predicted_ms"), "tok_per_s": float(tm.get("predicted_per_second", 0.0) or 0.0),
        "prompt_n": tm.get("prompt_n"), "cache_n": tm.get("cache_n"), "prompt_ms": tm.get("prompt_ms"),
        "draft_n": draft_n, "draft_n_accepted": accepted,
        "acceptance": (accepted / draft_n) if draft_n else None,
        "tau": tau, "tau_source": tau_source,
        "finish_reason": choice.get("finish_reason"),
        "completion_tokens": (resp.get("usage") or {}).get("completion_tokens"),
        "wall_s": wall_s, "text": text, "has_timings": bool(tm),
    }


# -- main -------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    target = resolve_target(args.target)
    llama_bin = None if args.no_llama else find_llama_server(args.bin)
    edgespec_cmd = [] if args.no_edgespec else find_edgespec(args.edgespec_bin)
    supported = None
    if llama_bin:
        supported = supported_spec_types(run_text([llama_bin, "--help"]))
        if not supported:
            log(f"warning: `{llama_bin} --help` lists no --spec-type values; running every --spec-type given")
            supported = None
    configs, skipped = make_configs(args, supported)
    for s in skipped:
        log(f"warning: skipping {s}")
    if not configs:
        raise AnchorError("no config left to run")
    suites = {s: load_suite(s, args.max_sessions, args.max_tokens_cap, args.per_category) for s in args.suite}
    for s, sessions in suites.items():
        log(f"{s}: {len(sessions)} sessions, {len(requests_of(sessions))} requests")
    env = environment(llama_bin, target)

    from openai import OpenAI

    keep = args.log_dir is not None
    log_dir = Path(args.log_dir) if keep else Path(tempfile.mkdtemp(prefix="server-anchor-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    commands: list[dict[str, Any]] = []
    try:
        for rnd in range(args.rounds):
            for suite, sessions in suites.items():
                for cfg in round_order(configs, rnd):
                    port = free_port()
                    cmd = command(cfg, args, target, port, llama_bin, edgespec_cmd)
                    name = f"round {rnd + 1}/{args.rounds} {suite} {cfg.name}"
                    log(f"{name}: starting on port {port}")
                    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"r{rnd + 1}-{suite}-{cfg.name}")
                    load = os.getloadavg()[0]
                    with Server(cfg.name, cmd, port, log_dir / f"{slug}.log", args.start_timeout) as server:
                        log(f"{name}: ready in {server.ready_s:.1f} s (load average {load:.2f})")
                        commands.append({"round": rnd + 1, "suite": suite, "config": cfg.name,
                                         "command": shlex.join(cmd), "ready_s": server.ready_s,
                                         "loadavg_1m": load})
                        client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                        timeout=args.request_timeout)
                        for request, category, turn in requests_of(sessions):
                            try:
                                resp, wall = ask(client, turn["messages"], turn["max_tokens"])
                            except Exception as e:  # noqa: BLE001 - the client's error, one line
                                raise AnchorError(f"{name}: request {request} failed: {type(e).__name__}: "
                                                  f"{str(e)[:300]}") from None
                            r = record(cfg, suite, rnd, request, category, turn["max_tokens"], resp, wall)
                            if not r["has_timings"]:
                                log(f"warning: {name}: {request}: the response has no `timings` object")
                            records.append(r)
                            drafted = (f", draft {r['draft_n_accepted']}/{r['draft_n']}"
                                       if r["draft_n"] is not None else "")
                            log(f"  {request}: {r['predicted_n']} tok, {r['tok_per_s']:.1f} tok/s{drafted}")
                    log(f"{name}: stopped")
    except BaseException:
        if not keep:
            log(f"server logs kept in {log_dir}")
        raise
    if not keep:
        shutil.rmtree(log_dir, ignore_errors=True)
    summary = summarise(records)
    mismatches = text_mismatches(records)
    return {"meta": {"args": {k: v for k, v in vars(args).items()}, "environment": env,
                     "configs": [dataclasses.asdict(c) for c in configs], "skipped": skipped,
                     "spec_types_supported": sorted(supported) if supported else None,
                     "suites": {s: [x for x, _, _ in requests_of(v)] for s, v in suites.items()},
                     "commands": commands},
            "records": records, "summary": summary, "mismatches": mismatches}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except AnchorError as e:
        print(f"server_anchor.py: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("server_anchor.py: interrupted", file=sys.stderr)
        return 130
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        log(f"wrote {out}")
    print(markdown(result["summary"], result["mismatches"], args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
