"""What a generation reports: counts, acceptance, time split, memory."""

from __future__ import annotations

import resource
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edgespec.schedule.rate import Decision


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB."""
    try:  # Linux: VmHWM is reset by exec; ru_maxrss keeps the parent's peak in a forked child
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


@dataclass
class Stats:
    """Counters for one generation (or summed over several with `merge`).

    τ (tau) is the mean number of tokens emitted per target forward pass; plain decoding has τ = 1.
    """

    n_prompt: int = 0  # prompt tokens
    n_prompt_evaluated: int = 0  # prompt tokens actually evaluated (the rest came from the KV cache)
    n_tokens: int = 0  # generated tokens
    cycles: list[tuple[int, int]] = field(default_factory=list)  # per target pass: (drafted, accepted)
    t_prefill: float = 0.0
    t_draft: float = 0.0
    t_verify: float = 0.0  # target forward passes of the decode cycles
    t_other: float = 0.0  # sampling, verification, detokenization, bookkeeping
    t_plain: float = 0.0  # time in cycles that verified no draft (plain steps)
    t_window: float = 0.0  # wall time from the end of the prompt to the last chunk (native llama.cpp's
    # "decoded … in" window: t_decode plus the loop's untimed bookkeeping and the consumer's share)
    t_schedule: float = 0.0  # the scheduler's own decisions (-k auto)
    t_rollback: float = 0.0  # a recurrent target's rollbacks: restore + re-evaluation (part of t_other)
    n_rollbacks: int = 0  # partial acceptances a recurrent target paid a rollback for
    n_planned: int = 0  # cycles the scheduler planned
    n_probes: int = 0  # of them, probes (a losing drafter tried again)
    predicted_tokens: float = 0.0  # the scheduler's expected tokens, summed over planned cycles
    predicted_s: float = 0.0  # and its expected time for them
    peak_rss_mb: float = 0.0
    by_member: Counter[str] = field(default_factory=Counter)  # a chain's cycles verified per member
    tree_cycles: int = 0  # cycles that verified a draft tree (their `cycles` entry: nodes, path length)

    @property
    def t_decode(self) -> float:
        return self.t_draft + self.t_verify + self.t_other

    @property
    def n_cycles(self) -> int:
        """Target forward passes after the prompt."""
        return len(self.cycles)

    @property
    def n_drafted(self) -> int:
        return sum(d for d, _ in self.cycles)

    @property
    def n_accepted(self) -> int:
        return sum(n for _, n in self.cycles)

    @property
    def n_wasted(self) -> int:
        """Draft positions verified and rejected: the first rejected one and every one after it."""
        return sum(d - n for d, n in self.cycles)

    @property
    def wasted_per_token(self) -> float:
        """Rejected draft positions verified per generated token (what a confidence cut saves)."""
        return self.n_wasted / self.n_tokens if self.n_tokens else 0.0

    @property
    def drafted_at(self) -> list[int]:
        """[i] = cycles that drafted position i+1."""
        return [sum(1 for d, _ in self.cycles if d > i) for i in range(max((d for d, _ in self.cycles), default=0))]

    @property
    def accepted_at(self) -> list[int]:
        """[i] = cycles that accepted position i+1 (and so every position before it)."""
        return [sum(1 for _, n in self.cycles if n > i) for i in range(max((n for _, n in self.cycles), default=0))]

    @property
    def gamma_histogram(self) -> dict[int, int]:
        """Draft tokens verified per cycle (0 = a plain step) → number of cycles."""
        return dict(sorted(Counter(d for d, _ in self.cycles).items()))

    @property
    def predicted_tok_per_s(self) -> float:
        """The scheduler's cost model's speed for the cycles it planned (compare with tok_per_s)."""
        return self.predicted_tokens / self.predicted_s if self.predicted_s > 0 else 0.0

    @property
    def tau(self) -> float:
        return self.n_tokens / self.n_cycles if self.n_cycles else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def tok_per_s(self) -> float:
        """Decode speed: generated tokens over decode time (prompt processing excluded)."""
        return self.n_tokens / self.t_decode if self.t_decode > 0 else 0.0

    def record_cycle(self, n_draft: int, n_accepted: int, seconds: float = 0.0, plan: Decision | None = None,
                     split: tuple[float, float, float, float] | None = None) -> None:
        """One cycle: `seconds` in all; `split` = its time drafting, verifying, rolling back (a
        recurrent target's re-evaluation) and after verifying (rolling back included)."""
        self.cycles.append((n_draft, n_accepted))
        if n_draft == 0:
            self.t_plain += seconds
        if split is not None:
            self.t_draft += split[0]
            self.t_verify += split[1]
            self.t_rollback += split[2]
            self.n_rollbacks += split[2] > 0
            self.t_other += split[3]
        if plan is not None:
            self.n_planned += 1
            self.n_probes += plan.probe
            if plan.member is not None and n_draft:
                self.by_member[plan.member] += 1
            self.t_schedule += plan.seconds
            self.predicted_tokens += plan.tokens
            self.predicted_s += plan.ms / 1000

    def finish(self, t_window: float) -> None:
        """The generation ended `t_window` seconds after its prompt was read."""
        self.peak_rss_mb = peak_rss_mb()
        self.t_window = t_window

    def merge(self, other: Stats) -> Stats:
        out = Stats()
        for name in ("n_prompt", "n_prompt_evaluated", "n_tokens", "t_prefill", "t_draft", "t_verify", "t_other",
                     "t_plain", "t_window", "t_schedule", "t_rollback", "n_rollbacks", "n_planned", "n_probes",
                     "predicted_tokens", "predicted_s", "tree_cycles"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.cycles = self.cycles + other.cycles
        out.by_member = self.by_member + other.by_member
        out.peak_rss_mb = max(self.peak_rss_mb, other.peak_rss_mb)
        return out

    def summary(self) -> str:
        line = f"{self.n_tokens} tokens, {self.tok_per_s:.1f} tok/s"
        if self.n_drafted:
            line += (f", τ {self.tau:.2f}, acceptance {self.acceptance_rate:.0%}, "
                     f"wasted verify {self.wasted_per_token:.2f}/token")
        return line
