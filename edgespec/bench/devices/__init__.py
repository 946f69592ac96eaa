"""The device zoo: cost profiles of real machines, from cited public measurements, for replaying the
scheduler against recorded drafter traces (docs/devices.md).

A profile is a JSON file: `t_ms` gives T(k), the ms of one target forward over k tokens, for the k
that were measured; `draft` gives each drafter kind's (fixed, per-token) cost as fractions of T(1);
`sources` and `notes` say where every number came from and what was assumed. `load_device` fills
T(1..32) by linear interpolation between measured k, so a kernel step is kept exactly where the
profile gives both sides of it (T(8) and T(9) for CUDA's MMVQ limit of 8 rows).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

K_MAX = 32
KINDS = ("ngram", "history", "model", "head", "mtp", "assistant")
READ_SHARE = 0.1  # an assumption where a profile gives no read cost (docs/devices.md)
_HERE = Path(__file__).parent


@dataclass(frozen=True)
class Device:
    name: str
    description: str
    t_ms: tuple[float, ...]  # index 0 unused (0.0), then T(1)..T(32) in ms
    draft: dict[str, tuple[float, float]] = field(default_factory=dict)  # kind -> (fixed, per token), × T(1)
    ctx_us: float = 0.0  # attention: µs per query token per cached token
    # kind -> × T(1) per context token a stateful drafter (a draft model, a head) reads when it catches
    # up on what it did not draft (a prompt, tokens another drafter proposed); absent: see read_ms
    read: dict[str, float] = field(default_factory=dict)
    interpolated: tuple[int, ...] = ()  # k filled in by the loader, not given by the profile
    sources: tuple[str, ...] = ()

    def t(self, k: int) -> float:
        """T(k) in ms (1 ≤ k ≤ 32)."""
        return self.t_ms[k]

    def draft_ms(self, kind: str, gamma: int) -> float:
        """ms to draft `gamma` tokens with a drafter of `kind`: (fixed + gamma·per_token)·T(1)."""
        if kind not in self.draft:
            raise KeyError(f"device {self.name!r} has no cost for drafter kind {kind!r} "
                           f"(it has: {', '.join(sorted(self.draft)) or 'none'})")
        if gamma <= 0:
            return 0.0
        fixed, per_token = self.draft[kind]
        return (fixed + gamma * per_token) * self.t_ms[1]

    def read_ms(self, kind: str) -> float:
        """ms per context token a drafter of `kind` reads in a batch: the profile's `read`, else a tenth
        of its drafted token (READ_SHARE: a batched read per token against a decode step; a copying
        drafter reads nothing)."""
        if kind in self.read:
            return self.read[kind] * self.t_ms[1]
        return READ_SHARE * self.draft.get(kind, (0.0, 0.0))[1] * self.t_ms[1]


def bundled() -> list[str]:
    """The names of the bundled profiles."""
    return sorted(p.stem for p in _HERE.glob("*.json"))


def load_device(name_or_path: str | Path) -> Device:
    """A bundled profile by name (edgespec/bench/devices/<name>.json) or a profile JSON file.

    T(k) for k = 1..32 that the file does not give is filled by linear interpolation between the
    nearest measured k on either side; beyond the largest measured k it is extrapolated linearly
    from the last two measured points (held flat if only one point is measured, and never below
    the last measured T). The filled k are listed in `Device.interpolated`. Steps survive: a
    profile that gives T(8) and T(9) keeps exactly that jump between them.
    Raises ValueError (one line, naming the file) for a file that is not a valid profile."""
    path = Path(name_or_path).expanduser()
    if not path.suffix and not path.exists():
        path = _HERE / f"{name_or_path}.json"
    if not path.is_file():
        raise ValueError(f"{path}: no such device profile (bundled: {', '.join(bundled())})")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not valid JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a profile is a JSON object")
    try:
        measured = {int(k): float(v) for k, v in (data.get("t_ms") or {}).items()}
    except (TypeError, ValueError, AttributeError):
        raise ValueError(f"{path}: t_ms must map k (1..{K_MAX}) to ms") from None
    _check_t(path, measured)
    try:
        draft = {str(kind): (float(c[0]), float(c[1])) for kind, c in (data.get("draft") or {}).items()}
    except (TypeError, ValueError, IndexError, AttributeError):
        raise ValueError(f"{path}: draft must map a drafter kind to [fixed, per_token]") from None
    if any(c < 0 for pair in draft.values() for c in pair):
        raise ValueError(f"{path}: draft costs must be ≥ 0")
    try:
        read = {str(kind): float(v) for kind, v in (data.get("read") or {}).items()}
    except (TypeError, ValueError, AttributeError):
        raise ValueError(f"{path}: read must map a drafter kind to a fraction of T(1)") from None
    sources = data.get("sources") or []
    if isinstance(sources, str) or not all(isinstance(s, str) for s in sources):
        raise ValueError(f"{path}: sources must be a list of strings")
    t, filled = _fill(measured)
    return Device(name=str(data.get("name") or path.stem), description=str(data.get("description", "")),
                  t_ms=t, draft=draft, ctx_us=float(data.get("ctx_us") or 0.0), read=read,
                  interpolated=filled, sources=tuple(sources))


def from_profile(path: str | Path) -> Device:
    """A device from a cost profile `edgespec profile` wrote (calibration.CostProfile's JSON, cached
    under $EDGESPEC_HOME/profiles; `edgespec profile` prints "saved <path>" or "T(k) from the cache
    <path>"): its t_forward_ms, its context_ms (ms per cached token per verified token → ctx_us),
    and its drafter's cost (draft_kind, draft_fixed_ms, draft_per_token_ms → fractions of T(1))."""
    path = Path(path).expanduser()
    try:
        data = json.loads(path.read_text())
        measured = {int(k): float(v) for k, v in data["t_forward_ms"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not an edgespec cost profile ({type(e).__name__}: {e})".splitlines()[0]) from None
    _check_t(path, measured)
    t, filled = _fill(measured)
    draft = {"ngram": (0.0, 0.0), "history": (0.0, 0.0)}
    if data.get("draft_kind") and (data.get("draft_fixed_ms") or data.get("draft_per_token_ms")):
        t1 = measured[1]
        draft[str(data["draft_kind"])] = (float(data.get("draft_fixed_ms") or 0.0) / t1,
                                          float(data.get("draft_per_token_ms") or 0.0) / t1)
    ctx = data.get("context_ms")
    return Device(name=Path(str(data.get("model", path.stem))).stem,
                  description=f"{data.get('model', '')} · {data.get('backend', '')} {data.get('version', '')} · "
                              f"{data.get('threads', '?')} threads · measured {data.get('measured_at', '?')}",
                  t_ms=t, draft=draft, ctx_us=1000.0 * float(ctx) if ctx else 0.0, interpolated=filled,
                  sources=(str(path),))


def _check_t(path: Path, measured: dict[int, float]) -> None:
    if 1 not in measured:
        raise ValueError(f"{path}: t_ms must give T(1)")
    bad = [k for k, v in measured.items() if not 1 <= k <= K_MAX or not v > 0]
    if bad:
        raise ValueError(f"{path}: t_ms needs 1 ≤ k ≤ {K_MAX} and T(k) > 0 (bad k: {sorted(bad)})")


def _fill(measured: dict[int, float]) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """T(0..32) (T(0) = 0) from the measured k, and the k that were filled."""
    ks = sorted(measured)
    t = [0.0] * (K_MAX + 1)
    for k in range(1, K_MAX + 1):
        if k in measured:
            t[k] = measured[k]
        elif k < ks[-1]:
            lo = max(m for m in ks if m < k)
            hi = min(m for m in ks if m > k)
            t[k] = measured[lo] + (measured[hi] - measured[lo]) * (k - lo) / (hi - lo)
        elif len(ks) == 1:
            t[k] = measured[ks[-1]]
        else:
            a, b = ks[-2], ks[-1]
            t[k] = max(measured[b], measured[b] + (measured[b] - measured[a]) * (k - b) / (b - a))
    return tuple(t), tuple(k for k in range(1, K_MAX + 1) if k not in measured)
