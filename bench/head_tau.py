"""Chained acceptance of EAGLE-3 heads on a train-head work directory's held-out caches: the head
drafts from its own tokens and hidden state, γ = ``--depth``, at every origin in the greedy part of each
held-out sequence (``edgespec.train.evaluate.chain_acceptance``; numpy, no torch).

    .venv/bin/python bench/head_tau.py --target gemma3 --work-dir ~/.cache/edgespec/train/gemma3-s21 \\
        models/gemma3-270m-eagle3.gguf /tmp/s21/gemma3-eagle3.gguf

Prints, per head and held-out set (``heldout``: bench/heldout's prompts; ``heldout-gen``: the
``--heldout-gen`` replies), the acceptance of drafts 1..depth (all right so far) and τ = mean accepted
+ 1. τ is averaged over origins, not cycles, so it weights long accepted runs more than bench's
per-cycle τ: use it to compare heads on the same data, not to predict bench.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from edgespec.bench.provenance import line, provenance
from edgespec.heads.eagle3 import Eagle3Head
from edgespec.heads.gguf_io import read_eagle3_gguf
from edgespec.models import resolve_model
from edgespec.train.evaluate import chain_acceptance
from edgespec.train.features import FeatureCache
from edgespec.train.pipeline import target_info

SETS = ("heldout", "heldout-gen")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="the heads' target (GGUF path or model name)")
    ap.add_argument("--work-dir", required=True, type=Path, help="a train-head work directory")
    ap.add_argument("--depth", type=int, default=5, help="γ: drafts per chain")
    ap.add_argument("heads", nargs="+", type=Path, help="EAGLE-3 head GGUFs")
    args = ap.parse_args()
    print(f"ran at: {line(provenance())}", flush=True)
    work = args.work_dir.expanduser()
    sets = [s for s in SETS if (work / s).is_dir()]
    if not sets:
        raise SystemExit(f"{work} has no held-out cache ({' or '.join(SETS)}): run train-head there first")
    emb = target_info(resolve_model(args.target))["tok_embd"]
    for path in args.heads:
        config, tensors = read_eagle3_gguf(path)
        head = Eagle3Head(config, tensors, tok_embd=emb)
        for name in sets:
            r = chain_acceptance(head, FeatureCache(work / name).files(), depth=args.depth)
            acc = " ".join(f"{a:.3f}" for a in r["acceptance"])
            print(f"{path.name:32s} {name:12s} origins {r['origins']:6d}  acceptance {acc}  τ {r['tau']:.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
