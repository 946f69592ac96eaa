"""Cost profiles: the target's forward time T(k) over k tokens (logits for every row, what
verification pays), a drafter's cost, and the ideal speedup they allow.

ideal speedup(γ) = E[τ(γ)] · T(1) / (T_draft(γ) + T(γ+1))

Times are medians over repeats whose k order alternates (1..K, then K..1), so drift on a shared
machine hits every k alike. Profiles are cached as JSON under $EDGESPEC_HOME/profiles, keyed by
model sha256, backend, threads and backend version.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from edgespec.backends.base import Backend

CONTEXT_TOKENS = 64  # tokens in the cache while timing: a short prompt's worth


@dataclass
class CostProfile:
    model: str
    sha256: str
    backend: str
    version: str
    threads: int
    t_forward_ms: dict[int, float]  # k -> median ms for a k-token forward with k logit rows
    draft_kind: str | None = None
    draft_fixed_ms: float = 0.0  # per cycle (e.g. syncing the draft model's cache)
    draft_per_token_ms: float = 0.0
    measured_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S"))

    def t_verify(self, k: int) -> float:
        return self.t_forward_ms[k]

    def t_draft(self, gamma: int) -> float:
        return 0.0 if gamma == 0 else self.draft_fixed_ms + gamma * self.draft_per_token_ms

    def ideal_speedup(self, gamma: int, expected_tau: float) -> float:
        """E[τ(γ)]·T(1) / (T_draft(γ) + T(γ+1)): the speedup if the runtime itself cost nothing."""
        return expected_tau * self.t_forward_ms[1] / (self.t_draft(gamma) + self.t_forward_ms[gamma + 1])

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> CostProfile:
        data = json.loads(text)
        data["t_forward_ms"] = {int(k): v for k, v in data["t_forward_ms"].items()}
        return cls(**data)


def profile_dir() -> Path:
    from edgespec.models import edgespec_home

    return edgespec_home() / "profiles"


def cache_path(sha256: str, backend: str, threads: int, version: str) -> Path:
    return profile_dir() / f"{sha256[:16]}-{backend}-t{threads}-v{version}.json"


def time_forward(backend: Backend, ks: Sequence[int], repeats: int = 5,
                 progress: Callable[[int, int], None] | None = None) -> dict[int, float]:
    """Median ms of a k-token forward (all k logit rows) after CONTEXT_TOKENS cached tokens."""
    base = [(7 * i + 11) % (min(backend.n_vocab, 1000) - 1) + 1 for i in range(CONTEXT_TOKENS + max(ks))]
    backend.truncate(0)
    backend.eval(base[:CONTEXT_TOKENS], rows="none")
    backend.eval(base[CONTEXT_TOKENS:CONTEXT_TOKENS + 1], rows="all")  # warm-up
    backend.truncate(CONTEXT_TOKENS)
    times: dict[int, list[float]] = {k: [] for k in ks}
    for r in range(repeats):
        for k in (ks if r % 2 == 0 else list(reversed(ks))):
            t0 = time.perf_counter()
            backend.eval(base[CONTEXT_TOKENS:CONTEXT_TOKENS + k], rows="all")
            times[k].append((time.perf_counter() - t0) * 1000)
            backend.truncate(CONTEXT_TOKENS)
        if progress:
            progress(r + 1, repeats)
    backend.truncate(0)
    return {k: statistics.median(v) for k, v in times.items()}


def ideal_speedup_at(t_forward_ms: dict[int, float], t_draft: Callable[[int], float],
                     cycles: Sequence[tuple[int, int]], gamma: int | None = None) -> float | None:
    """The speedup of these very cycles (drafted, accepted) at zero runtime overhead:
    Σ tokens · T(1) / Σ (T_draft(d) + T(d+1)). With `gamma`, each cycle recorded at a larger γ is
    truncated to d = min(drafted, γ): a deterministic drafter's first γ tokens are the same at any
    γ, and one that proposes fewer (n-gram without a match) pays only the shorter verification.
    None when T(d+1) was not measured or there are no cycles."""
    ds = [(d if gamma is None else min(d, gamma), n) for d, n in cycles]
    if not ds or any(d + 1 not in t_forward_ms for d, _ in ds):
        return None
    tokens = sum(min(n, d) + 1 for d, n in ds)
    cost = sum(t_draft(d) + t_forward_ms[d + 1] for d, _ in ds)
    return tokens * t_forward_ms[1] / cost


def expected_tau(accepted: Sequence[int], drafted: Sequence[int], gamma: int) -> float:
    """E[τ(γ)] estimated from cycles of a run at a larger γ: a deterministic drafter's first γ
    tokens are the same at any γ ≥ them, so a cycle that drafted L and had n accepted would have
    emitted min(n, γ, L) + 1 tokens at γ. `accepted`/`drafted`: one entry per cycle."""
    if not accepted:
        return 1.0
    return sum(min(n, gamma, d) + 1 for n, d in zip(accepted, drafted)) / len(accepted)
