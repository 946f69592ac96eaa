"""Anchor: run llama.cpp's native `llama-speculative-simple` on the edgespec bench tasks.

Same model pair, same prompt tokens (rendered by edgespec's chat template code and checked token
for token), same token budget, greedy, same threads and context, so its decode tok/s can be set
beside `edgespec bench`. Build the binary first with bench/anchors/build.sh.

    .venv/bin/python bench/anchors/native.py --target PATH --drafter PATH|ngram \
        --n-max 4 [--n-max 8] [--category code_edit ...] --out FILE.json

`--n-max 0` runs the same native loop with a drafter that never drafts (plain decoding baseline).
`--edgespec-auto` also runs edgespec `-k auto` on the same pair, right after the native runs of the
same task and repeat, so that `python -m edgespec.bench.anchor_compare FILE.json` can divide
speeds measured seconds apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BIN_NAME = "llama-speculative-simple"

_RE_ENC = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.naif]+) t/s")
_RE_DEC = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.naif]+) t/s")
_RE_KV = re.compile(r"\b(n_draft|n_predict|n_drafted|n_accept)\s+=\s+(\d+)\s*$", re.M)


def find_binary(explicit: str | None) -> Path:
    if explicit:
        p = Path(explicit).expanduser()
        if not os.access(p, os.X_OK):
            sys.exit(f"not an executable: {p}")
        return p
    if os.environ.get("EDGESPEC_ANCHOR_BIN"):
        return find_binary(os.environ["EDGESPEC_ANCHOR_BIN"])
    home = Path(os.environ.get("EDGESPEC_HOME", Path.home() / ".cache" / "edgespec")).expanduser()
    hits = sorted(glob.glob(str(home / "anchors" / "build-*" / "bin" / BIN_NAME)))
    if not hits:
        sys.exit(f"{BIN_NAME} not found under {home / 'anchors'}; run bench/anchors/build.sh or pass --bin")
    return Path(hits[-1])


def native_flags(args: argparse.Namespace, target: str, drafter: str, n_max: int) -> list[str]:
    """Flags shared by every run of one config (prompt file and -n are added per task)."""
    t = str(args.threads)
    flags = ["-m", target, "-c", str(args.ctx), "-b", str(args.ctx), "-ub", str(args.ubatch),
             "-t", t, "-tb", t, "--temp", "0", "--top-k", "1", "-s", "0", "--log-colors", "off"]
    if not args.native_defaults:
        # what edgespec's LlamaCppBackend sets: no weight repacking, Q8_0 KV cache, full SWA cache
        flags += ["--no-repack", "-ctk", args.kv_type, "-ctv", args.kv_type, "--swa-full"]
    if n_max == 0:
        # plain decoding through the same loop: an n-gram drafter that can never match
        flags += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "1024",
                  "--spec-ngram-simple-size-m", "1"]
    elif drafter == "ngram":
        # ngram-simple never drafts fewer tokens than its lookup size: keep size-n <= n_max
        flags += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(min(args.ngram_n, n_max)),
                  "--spec-ngram-simple-size-m", str(n_max), "--spec-ngram-simple-min-hits", "1"]
    else:
        from edgespec.drafters.heads import head_arch
        from edgespec.gguf_file import read_gguf

        arch = head_arch(drafter)  # a DFlash file with DSpark's Markov head runs as draft-dspark
        dspark = arch == "dflash" and "markov_w1.weight" in read_gguf(drafter, lambda k: False).tensors
        kind = {"eagle3": "draft-eagle3", "dflash": "draft-dspark" if dspark else "draft-dflash"}.get(arch, "draft-simple")
        flags += ["--spec-type", kind, "-md", drafter, "--spec-draft-n-max", str(n_max),
                  "--spec-draft-n-min", "0", "--spec-draft-p-min", "0", "-td", t, "-tbd", t]
        if not args.native_defaults:
            flags += ["-ctkd", args.kv_type, "-ctvd", args.kv_type]
    return flags


def parse_output(text: str) -> dict:
    enc, dec = _RE_ENC.search(text), _RE_DEC.search(text)
    kv = {k: int(v) for k, v in _RE_KV.findall(text)}
    if not dec or "n_drafted" not in kv or "n_accept" not in kv:
        raise ValueError("no 'decoded … t/s' / n_drafted / n_accept lines in the native output")
    n_tok, dec_s = int(dec.group(1)), float(dec.group(2))
    return dict(n_tokens=n_tok, decode_s=dec_s, tok_per_s=n_tok / dec_s if dec_s > 0 else 0.0,
                native_tok_per_s=float(dec.group(3)), n_drafted=kv["n_drafted"], n_accepted=kv["n_accept"],
                n_prompt=int(enc.group(1)) if enc else None, prompt_s=float(enc.group(2)) if enc else None)


def generated_text(out: str, prompt: str) -> str | None:
    """Best effort: the text the binary printed after echoing the prompt (None if not found)."""
    start = out.find(prompt)
    end = _RE_ENC.search(out)
    if start < 0 or not end:
        return None
    body = out[start + len(prompt): end.start()]
    body = body[: body.rfind("\n\n")] if "\n\n" in body else body
    return re.sub(r"\n[\d.]+ [A-Z] $", "", body)


def render(engine, task, chat: bool) -> tuple[str, list[int], str, bool]:
    """(edgespec's prompt text, edgespec's prompt tokens, text for the native -f file, tokens equal).

    The native binary tokenizes with add_special=True, parse_special=True. When edgespec tokenizes
    without adding BOS (the chat template already wrote it), the written BOS text is dropped so that
    the native tokenizer adds exactly one BOS. The result is checked against edgespec's tokens.
    """
    tgt = engine.target
    if chat:
        text, add_bos = engine.chat_prompt(list(task.messages))
        ids = tgt.tokenize(text, add_bos, True)
    else:
        text, add_bos = task.prompt, True
        ids = tgt.tokenize(text, True, False)
    native = text
    if tgt.tokenize(native, True, True) != ids and not add_bos and tgt.bos_id is not None:
        bos = tgt.vocab_fingerprint().token_text(tgt.bos_id)
        if bos and native.startswith(bos):
            native = native[len(bos):]
    return text, ids, native, tgt.tokenize(native, True, True) == ids


def run_native(args: argparse.Namespace, binary: Path, flags: list[str], task, n_max: int, rep: int,
               prompt: tuple[str, list[int], str, bool], tmp: Path, log_dir: Path | None) -> dict:
    """One native run of one task: its JSON row."""
    text, ids, native_text, same = prompt
    pfile = tmp / f"{task.id}.txt"
    # -f drops one trailing newline: add one so the prompt arrives unchanged
    pfile.write_text(native_text + "\n", encoding="utf-8")
    # the native loop stops once it has produced MORE than -n tokens: -n max-1 gives max
    cmd = [str(binary), *flags, "-f", str(pfile), "-n", str(task.max_tokens - 1)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=args.timeout, check=False)
    wall = time.perf_counter() - t0
    out = proc.stdout.decode("utf-8", "replace")
    if log_dir:
        (log_dir / f"{task.id}.n{n_max}.r{rep}.log").write_text(out, encoding="utf-8")
    if proc.returncode != 0:
        print(out[-3000:], file=sys.stderr)
        sys.exit(f"{BIN_NAME} exited {proc.returncode} on {task.id} (n_max {n_max})")
    r = parse_output(out)
    row = dict(task=task.id, category=task.category, drafter=args.drafter, n_max=n_max, loop="native",
               repeat=rep, tok_per_s=r["tok_per_s"], n_drafted=r["n_drafted"],
               n_accepted=r["n_accepted"], n_tokens=r["n_tokens"], max_tokens=task.max_tokens,
               acceptance=r["n_accepted"] / r["n_drafted"] if r["n_drafted"] else None,
               decode_s=r["decode_s"], native_tok_per_s=r["native_tok_per_s"],
               n_prompt=r["n_prompt"], n_prompt_edgespec=len(ids), prompt_s=r["prompt_s"],
               prompt_tokens_match=same and r["n_prompt"] == len(ids), wall_s=wall,
               text=generated_text(out, native_text))
    acc = f"{row['acceptance']:.0%}" if row["acceptance"] is not None else "-"
    print(f"{task.id:<22} n_max={n_max:<2} {row['n_tokens']:>4} tok  {row['tok_per_s']:7.1f} tok/s  "
          f"drafted {row['n_drafted']:>4}  accepted {row['n_accepted']:>4} ({acc})", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="target GGUF path (or edgespec model name)")
    ap.add_argument("--drafter", required=True, help="'ngram' (native ngram-simple), a draft GGUF path/name, "
                    "or a head GGUF (native draft-eagle3 / draft-dflash / draft-dspark)")
    ap.add_argument("--n-max", type=int, action="append", help="draft length γ (repeatable; 0 = plain). Default 4")
    ap.add_argument("--category", action="append", help="only these categories (repeatable)")
    ap.add_argument("--task", action="append", help="only these task ids (repeatable)")
    ap.add_argument("--tasks", help="a .jsonl file or folder (default: the shipped suite, edgespec/bench/suite)")
    ap.add_argument("--per-category", type=int, default=3, help="tasks per category, as edgespec bench (default 3)")
    ap.add_argument("--max-tokens", type=int, help="cap each task's max_tokens, as edgespec bench")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--ubatch", type=int, default=512, help="-ub (edgespec: n_batch = n_ubatch = 512)")
    ap.add_argument("--kv-type", default="q8_0", help="KV cache type (edgespec 'auto' = q8_0 for these models)")
    ap.add_argument("--ngram-n", type=int, default=3,
                    help="ngram-simple lookup n-gram size (--spec-ngram-simple-size-n; default 3)")
    ap.add_argument("--native-defaults", action="store_true",
                    help="keep llama.cpp's defaults (repacking, F16 KV, no --swa-full) instead of edgespec's")
    ap.add_argument("--bin", help=f"path to {BIN_NAME} (default: the one build.sh made)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per native run")
    ap.add_argument("--log-dir", help="keep each run's full native output here")
    ap.add_argument("--edgespec-auto", action="store_true",
                    help="after each task's native runs, run edgespec -k auto on the same pair (paired rows)")
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args(argv)

    from edgespec.api import load
    from edgespec.bench.provenance import provenance
    from edgespec.bench.run import run_one
    from edgespec.bench.tasks import load_tasks
    from edgespec.models import resolve_model

    binary = find_binary(args.bin)
    n_maxes = args.n_max or [4]
    if any(n < 0 for n in n_maxes):
        sys.exit("--n-max must be >= 0")
    target = str(Path(resolve_model(args.target)).resolve())
    drafter = "ngram" if args.drafter == "ngram" else str(Path(resolve_model(args.drafter)).resolve())

    chosen = load_tasks(args.tasks, args.category)
    if args.task:
        chosen = [t for t in chosen if t.id in set(args.task)]
        if not chosen:
            sys.exit(f"no task with id {', '.join(args.task)}")
    by_cat: dict[str, list] = {}
    for t in chosen:
        if len(by_cat.setdefault(t.category, [])) < args.per_category:
            cap = min(t.max_tokens, args.max_tokens or t.max_tokens)
            by_cat[t.category].append(dataclasses.replace(t, max_tokens=cap))
    selected = [t for ts in by_cat.values() for t in ts]

    # render every prompt with edgespec, then free the model before the native runs (kept, with
    # the drafter, when edgespec runs beside them)
    engine = load(target, drafter if args.edgespec_auto else None, n_ctx=args.ctx, threads=args.threads)
    try:
        chat = engine.target.metadata("tokenizer.chat_template") is not None
        prompts = {t.id: render(engine, t, chat) for t in selected}
    finally:
        if not args.edgespec_auto:
            engine.close()
    bad = [tid for tid, p in prompts.items() if not p[3]]
    if bad:
        print(f"warning: native prompt tokens differ from edgespec's for {', '.join(bad)}", file=sys.stderr)

    rows, commands = [], {}
    log_dir = Path(args.log_dir) if args.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    flags_of = {n: native_flags(args, target, drafter, n) for n in n_maxes}
    for n_max, flags in flags_of.items():
        commands[str(n_max)] = shlex.join([str(binary), *flags, "-f", "PROMPT", "-n", "MAX_TOKENS-1"])
    # task by task, every config of a task back to back: machine drift moves a task's runs together
    with tempfile.TemporaryDirectory(prefix="edgespec-anchor-") as tmp:
        for rep in range(args.repeats):
            for task in selected:
                for n_max in n_maxes:
                    rows.append(run_native(args, binary, flags_of[n_max], task, n_max, rep, prompts[task.id],
                                           Path(tmp), log_dir))
                if args.edgespec_auto:
                    gen, st = run_one(engine, task, dict(max_tokens=task.max_tokens, temperature=0.0, num_draft="auto"),
                                   chat, speculative=True)
                    rows.append(dict(task=task.id, category=task.category, drafter=args.drafter, n_max="auto",
                                     loop="edgespec", repeat=rep, tok_per_s=st.tok_per_s, n_tokens=st.n_tokens,
                                     n_drafted=st.n_drafted, n_accepted=st.n_accepted,
                                     max_tokens=task.max_tokens, text=gen.text))
                    print(f"{task.id:<22} edgespec auto {st.n_tokens:>4} tok  {st.tok_per_s:7.1f} tok/s", flush=True)
    if args.edgespec_auto:
        engine.close()

    meta = dict(binary=str(binary), target=target, drafter=drafter, n_max=n_maxes, threads=args.threads,
                edgespec_auto=args.edgespec_auto,
                ctx=args.ctx, ngram_n=args.ngram_n if drafter == "ngram" else None,
                native_defaults=args.native_defaults, chat_template=chat, repeats=args.repeats,
                tasks=[t.id for t in selected], commands=commands,
                machine=f"{platform.platform()}, {platform.machine()}, {os.cpu_count()} CPUs",
                **provenance(REPO))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), separators=(",", ":")) + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({len(rows)} rows)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
