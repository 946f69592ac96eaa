"""Drafter traces: what one drafter proposes at every position of a target's output, recorded once
and replayed exactly (edgespec.bench.replay) under any scheduling policy and any device's costs.

A `TraceSet` is one (target, drafter, temperature) over a suite of tasks, kept as one gzipped JSON
file. Each `Trace` holds the target's output for one task (greedy: its argmax chain; T > 0: one
seeded sample) and, for every position p, the draft the drafter made from the true context
(prompt + output[:p]), up to the longest draft it may make, with its confidences and (copying
drafters) the match it copies from. Greedy replay is exact: a draft of γ at p keeps the longest
prefix equal to output[p:]. At T > 0, `accept[p]` is the chance verification accepts the draft's
first token at p (Σ min(p, q); a one-hot q: p(x̃)): the replay draws each drafted position i of a
cycle at p as Bernoulli(accept[p + i]), an approximation (the real draft at p + i is made after
sampled, not recorded, tokens). A trace recorded with trees (record.py --tree-nodes) holds, per
position, the draft tree a tree drafter made there (greedy), whose chain of first children is
`drafts[p]`: a tree's accepted path is exact too (edgespec.bench.tree_replay). At T > 0 a side-tree
drafter's sampled tree is recorded (confidences: each node's probability in the row it was drawn from)
with `tree_accept[p]`, the exact chances of the root's children, chain token first, each sibling's
given the tokens before it were rejected (recursive rejection sampling); the replay stands a depth-i
position of a cycle at p for the root's children recorded at p + i, as for chains.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = 1
KINDS = ("ngram", "history", "model", "head", "mtp", "assistant")  # cost kinds (bench.devices)


@dataclass
class Trace:
    """One task's output and what the drafter proposed at each of its positions."""

    task: str
    category: str
    prompt_len: int
    output: list[int]  # the target's emitted tokens (the end-of-text token included when eos)
    eos: bool
    max_tokens: int
    drafts: list[list[int]]  # drafts[p]: proposed after prompt + output[:p]; len(drafts) == len(output)
    confidence: list[list[float]] | None = None  # per drafted token, the drafter's own (None: gives none)
    support: list[int | None] | None = None  # per position, the match a copying drafter copies from
    accept: list[float] | None = None  # T > 0: per position, P(first draft token accepted)
    draft_ms: list[float] | None = None  # per position, ms the draft took on the recording machine
    trees: list[list[list]] | None = None  # per position: a draft tree [tokens, parents, confidences]
    # T > 0 (side trees): per position, the chance verification accepts each of the root's children in
    # draw order: the chain's token, then each sibling once the tokens before it were rejected
    tree_accept: list[list[float]] | None = None


@dataclass
class TraceSet:
    """One (target, drafter, temperature) over a suite: the traces and where they were recorded."""

    target: str
    drafter: str  # the drafter spec as recorded (a chain is recorded member by member)
    kind: str  # its cost kind, one of KINDS: which of a device's drafter costs prices it
    temperature: float
    longest: int  # the longest draft recorded at each position
    t_forward_ms: dict[int, float]  # the recording machine's T(k) for the target
    draft_fixed_ms: float  # the recording machine's drafting cost: fixed + γ · per_token (ms)
    draft_per_token_ms: float
    machine: str  # CPU model name (/proc/cpuinfo) or other device description
    commit: str
    date: str
    traces: list[Trace] = field(default_factory=list)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = dataclasses.asdict(self) | {"format": FORMAT}
        with gzip.open(path, "wt", encoding="utf-8") as f:
            json.dump(data, f, separators=(",", ":"))
        return path

    @classmethod
    def load(cls, path: str | Path) -> TraceSet:
        try:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}: not a trace file ({err})") from None
        if data.pop("format", None) != FORMAT:
            raise ValueError(f"{path}: trace format is not {FORMAT}")
        data["t_forward_ms"] = {int(k): float(v) for k, v in data["t_forward_ms"].items()}
        data["traces"] = [Trace(**t) for t in data["traces"]]
        return cls(**data)
