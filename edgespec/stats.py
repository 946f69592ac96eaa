"""What a generation reports: counts, acceptance, time split, memory."""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass, field


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
    n_cycles: int = 0  # target forward passes after the prompt
    n_drafted: int = 0  # draft tokens proposed (and verified)
    n_accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # [i] = drafts accepted at position i+1
    drafted_at: list[int] = field(default_factory=list)  # [i] = drafts proposed at position i+1
    cycles: list[tuple[int, int]] = field(default_factory=list)  # per cycle: (drafted, accepted)
    t_prefill: float = 0.0
    t_draft: float = 0.0
    t_verify: float = 0.0  # target forward passes of the decode cycles
    t_other: float = 0.0  # sampling, verification, detokenization, bookkeeping
    peak_rss_mb: float = 0.0

    @property
    def t_decode(self) -> float:
        return self.t_draft + self.t_verify + self.t_other

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

    def record_cycle(self, n_draft: int, n_accepted: int) -> None:
        self.n_cycles += 1
        self.cycles.append((n_draft, n_accepted))
        self.n_drafted += n_draft
        self.n_accepted += n_accepted
        for arr, n in ((self.drafted_at, n_draft), (self.accepted_at, n_accepted)):
            if len(arr) < n:
                arr.extend([0] * (n - len(arr)))
            for i in range(n):
                arr[i] += 1

    def merge(self, other: Stats) -> Stats:
        out = Stats()
        for name in ("n_prompt", "n_prompt_evaluated", "n_tokens", "n_cycles", "n_drafted", "n_accepted",
                     "t_prefill", "t_draft", "t_verify", "t_other"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        for name in ("accepted_at", "drafted_at"):
            a, b = getattr(self, name), getattr(other, name)
            n = max(len(a), len(b))
            setattr(out, name, [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)])
        out.cycles = self.cycles + other.cycles
        out.peak_rss_mb = max(self.peak_rss_mb, other.peak_rss_mb)
        return out

    def summary(self) -> str:
        line = f"{self.n_tokens} tokens, {self.tok_per_s:.1f} tok/s"
        if self.n_drafted:
            line += f", τ {self.tau:.2f}, acceptance {self.acceptance_rate:.0%}"
        return line
