"""Calibration: the target's forward time T(k) over k tokens (logits for every row, what
verification pays), what each cached token adds, and the largest exact verification batch; the
cost profiles the scheduler starts from (`Engine.calibrate`) and `edgespec profile` refines.

Times are medians over repeats whose k order alternates (1..K, then K..1), so drift on a shared
machine hits every k alike. Profiles are cached as JSON under $EDGESPEC_HOME/profiles, keyed by
model sha256, backend, threads and backend version.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from edgespec.backends.base import Backend

CONTEXT_TOKENS = 64  # tokens in the cache while timing: a short prompt's worth
CONTEXT_FAR = 256  # more cached tokens for timing what each one adds (context_cost)
SLOW_STEP_S = 0.02  # single steps slower than this (MLX on a small CPU): calibrate with 8 cached tokens


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
    exact_batch: int | None = None  # largest k whose k-token forward gives bit-identical logits to k single steps
    context_ms: float | None = None  # ms a verified token pays per cached token beyond CONTEXT_TOKENS
    read_ms: float | None = None  # ms per token of reading READ_TOKENS at once (a draft model's catch-up)
    measured_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S"))

    def t_verify(self, k: int) -> float:
        return self.t_forward_ms[k]

    def t_draft(self, gamma: int) -> float:
        return 0.0 if gamma == 0 else self.draft_fixed_ms + gamma * self.draft_per_token_ms

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


def backend_version(backend: Backend) -> str:
    """The installed version of the runtime behind a backend ("" for in-process ones)."""
    from importlib import metadata

    dist = {"llama.cpp": "llama_cpp_python", "mlx": "mlx"}.get(backend.name)
    try:
        return metadata.version(dist) if dist else ""
    except metadata.PackageNotFoundError:
        return ""


def profile_path(backend: Backend) -> Path | None:
    """Where this backend's cost profile is cached (None for a model that is not on disk)."""
    from edgespec.models import model_key

    if not Path(backend.path).exists():  # a GGUF file, or an MLX model directory
        return None
    return cache_path(model_key(backend.path), backend.name, backend.threads, backend_version(backend))


CALIBRATION_KS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 20, 24, 32)


def calibrate(backend: Backend, ks: Sequence[int] = CALIBRATION_KS, budget_s: float = 2.0,
              note: Callable[[str], None] | None = None, chunk: int | None = None,
              context: int | None = None, repeats: int | None = None) -> dict[int, float]:
    """T(k) in ms for `ks`: from the cached profile when it has them, else timed in about
    `budget_s` (`note` is told first) and cached. The scheduler's prior; `edgespec profile`
    measures more carefully and replaces it. `chunk`: forwards are split as the engine splits them.
    `context` and `repeats`: cached tokens and repeats to time with, instead of what the budget and
    the backend's speed say (a draft model's T(1) and T(2): a few steps after a short context)."""
    path = profile_path(backend)
    prof = load_profile(path)
    have = dict(prof.t_forward_ms) if prof is not None else {}
    missing = [k for k in ks if k not in have]
    if not missing:
        return have
    # a cached profile lacking some k (one made by an older version, or `edgespec profile --max-k 8`)
    # keeps what it has: only the missing k are timed, with the largest cached k ≤ max(ks) beside them
    # as the anchor their times are scaled by (the same units however busy the machine is now)
    anchor = max((k for k in have if k <= ks[-1]), default=None)
    timed = sorted({*missing, anchor} - {None})
    if note:
        note(f"timing {Path(backend.path).name} for the scheduler (once per model, ~{budget_s:.0f} s)")
    if context is None:
        context = 8 if _slow(backend) else CONTEXT_TOKENS  # a short context keeps the prefill affordable
    if repeats is not None:
        t = time_forward(backend, timed, repeats=repeats, chunk=chunk, context=context)
    elif sum(cost := _estimate(backend, timed, chunk, context)) <= budget_s:
        t = time_forward(backend, timed, repeats=max(1, min(5, int(budget_s / sum(cost)))), chunk=chunk,
                         context=context)
    else:  # a slow backend (MLX on a small CPU): the two timings, interpolated; refined online
        t = {k: float(c) * 1000 for k, c in zip(timed, cost)}
    scale = have[anchor] / t[anchor] if anchor is not None and t[anchor] > 0 else 1.0
    t = {**have, **{k: t[k] * scale for k in missing}}
    save_profile(path, backend, t_forward_ms=t)
    return t


def _estimate(backend: Backend, ks: Sequence[int], chunk: int | None, context: int) -> list[float]:
    """Seconds per forward of each k, from one timing of the smallest and the largest (T(k) is about
    linear in k)."""
    ends = [ks[0], ks[-1]]
    once = time_forward(backend, ends, repeats=1, chunk=chunk, context=context)
    return [float(c) / 1000 for c in np.interp(ks, ends, [once[k] for k in ends])]


def context_cost(backend: Backend, chunk: int | None = None, far: int = CONTEXT_FAR, repeats: int = 4,
                 note: Callable[[str], None] | None = None, refresh: bool = False) -> float:
    """ms each token of a forward pays per cached token beyond CONTEXT_TOKENS (attention: a batch
    does not share it), cached in the profile. T(16) is timed `repeats` times after CONTEXT_TOKENS
    cached tokens, after `far` more, and after CONTEXT_TOKENS again (medians; one prefill of the
    far tokens, the dearest part: ~1 s for 256 tokens of SmolLM2 here). 0 for a backend too slow
    to time it briefly (the scheduler then follows the cycles' timings alone), unless `refresh`
    asks for a measurement (`edgespec profile`): then it is timed however slow a step is."""
    path = profile_path(backend)
    prof = load_profile(path)
    if prof is not None and prof.context_ms is not None and not refresh:
        return prof.context_ms
    k, n0 = 16, CONTEXT_TOKENS
    far = min(far, backend.n_ctx - n0 - k)
    if far < 64:
        return 0.0
    if not refresh and _slow(backend):  # `refresh` (edgespec profile) times it anyway
        # kept, as any measurement: a step near SLOW_STEP_S (an F32 target here) must not time it
        # in whichever later engine meets a quick moment (~2 s of that engine's first generation)
        save_profile(path, backend, context_ms=0.0)
        return 0.0
    if note:
        note(f"timing what each cached token adds for {Path(backend.path).name} (once per model)")
    base = _timing_tokens(backend, n0 + far + k)
    backend.truncate(0)
    backend.eval(base[:n0], rows="none")
    _forward_ms(backend, base, n0, k, chunk)  # warm-up
    near = [_forward_ms(backend, base, n0, k, chunk) for _ in range(repeats)]
    backend.eval(base[n0:n0 + far], rows="none")
    farther = statistics.median(_forward_ms(backend, base, n0 + far, k, chunk) for _ in range(repeats))
    backend.truncate(0)  # timed again after (drift brackets the far timings); prefilled again, as a
    backend.eval(base[:n0], rows="none")  # recurrent state cannot go back past its checkpoint
    near = statistics.median(near + [_forward_ms(backend, base, n0, k, chunk) for _ in range(repeats)])
    backend.truncate(0)
    ms = max(0.0, (farther - near) / (k * far))
    save_profile(path, backend, context_ms=ms)
    return ms


EXACT_FIRST = 4  # batches checked before the single steps for the larger ones are taken


def exact_batch(backend: Backend, k_max: int = 16, note: Callable[[str], None] | None = None) -> int:
    """The largest k ≤ k_max for which a k-token forward returns exactly the logits of k single-token
    steps (cached in the profile). Beyond it, verification would not see what plain decoding sees:
    a backend may switch matmul kernels at some batch size (llama.cpp's CPU K-quant kernels do), and
    the logits past that size differ from single steps."""
    path = profile_path(backend)
    prof = load_profile(path)
    if prof is not None and prof.exact_batch is not None:
        return prof.exact_batch
    if note:
        note(f"checking which verification batches of {Path(backend.path).name} give exactly the logits "
             "of single steps (once per model)")
    best = k_max
    for seed in (0, 1):  # two contexts: a kernel switch can agree by chance on one
        n0 = max(1, min(CONTEXT_TOKENS * (seed + 1), backend.n_ctx - k_max))
        rng = np.random.default_rng(seed)
        toks = [int(t) for t in rng.integers(1, min(backend.n_vocab, 5000), n0 + k_max)]
        backend.truncate(0)
        backend.eval(toks[:n0], rows="none")
        backend.checkpoint()
        # single steps as far as a batch may still pass, a few first: a target exact only at 1 token
        # (F16, F32 on CPU) fails at 2 after 4 steps and its second context is not needed (~0.7 s)
        for lo, hi in ((2, min(best, EXACT_FIRST)), (EXACT_FIRST + 1, best)):
            if hi < lo or best < lo - 1:
                continue
            backend.truncate(n0)
            single = np.stack([backend.eval([t], rows="last")[0] for t in toks[n0:n0 + hi]])
            for k in range(lo, hi + 1):
                backend.truncate(n0)
                if not np.array_equal(backend.eval(toks[n0:n0 + k], rows="all"), single[:k]):
                    best = k - 1
                    break
        if best == 1:
            break
    backend.truncate(0)
    save_profile(path, backend, exact_batch=best)
    return best


def load_profile(path: Path | None) -> CostProfile | None:
    return CostProfile.from_json(path.read_text()) if path is not None and path.is_file() else None


def save_profile(path: Path | None, backend: Backend, **fields) -> None:
    """Update (or start) the cached profile with these fields, keeping the others."""
    if path is None:
        return
    from edgespec.models import model_key

    prof = load_profile(path) or CostProfile(backend.path, model_key(backend.path), backend.name,
                                      backend_version(backend), backend.threads, {})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(replace(prof, measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"), **fields).to_json())


PAIR_DECAY = 0.7  # what a pair's older generations weigh against the newest one


def pair_path(target: Backend, drafter_paths: Sequence[str], greedy: bool) -> Path | None:
    """Where the acceptance a (target, drafter) pair showed is kept (None: a drafter without files,
    or a model not on disk)."""
    key = _pair_key(target, drafter_paths)
    return None if key is None else profile_dir() / f"pair-{key}-{target.name}-{'greedy' if greedy else 'sampled'}.json"


def _pair_key(target: Backend, drafter_paths: Sequence[str]) -> str | None:
    from edgespec.models import model_key

    files = [target.path, *drafter_paths]
    if not drafter_paths or not all(Path(f).exists() for f in files):
        return None
    return "-".join(model_key(f)[:12] for f in files)


def pair_acceptance(target: Backend, drafter_paths: Sequence[str]) -> float | None:
    """The better of the pair's greedy and sampled mean acceptance (None: never seen)."""
    seen = [r for g in (True, False) if (r := load_acceptance(pair_path(target, drafter_paths, g))) is not None]
    return max(seen, default=None)


def vocab_path(target: Backend, drafter: Backend) -> Path | None:
    """Where it is kept that a draft model's vocabulary fits the target's (the two files' keys)."""
    key = _pair_key(target, [drafter.path])
    return None if key is None else profile_dir() / f"vocab-{key}.ok"


HANDOFF_DOUBT = 0.5  # a KV handoff pair whose drafts were right less often than this is probed


def handoff_path(target: Backend, drafter: Backend) -> Path | None:
    """Where a KV handoff pair's verdict and costs are kept (drafters.draft_model.open_kv_handoff)."""
    key = _pair_key(target, [drafter.path])
    return None if key is None else profile_dir() / f"handoff-{key}-v{backend_version(target)}.json"


def load_handoff(path: Path | None) -> dict | None:
    """{"use", "probed", "copy_ms", "read_ms"} as `save_handoff` kept them (None: none, or unreadable)."""
    try:
        rec = json.loads(path.read_text()) if path is not None else None
        return rec if rec is not None and {"use", "probed", "copy_ms", "read_ms"} <= rec.keys() else None
    except (OSError, ValueError, AttributeError):
        return None


def save_handoff(path: Path | None, use: bool, probed: bool, copy_ms: float, read_ms: float) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(use=use, probed=probed, copy_ms=copy_ms, read_ms=read_ms,
                                    measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"))))


def mean_acceptance(record: Sequence[float]) -> float | None:
    """A pair record [passed, judged]'s mean acceptance of verified draft positions (None: empty). The
    scheduler weighs it as the prior it replaces, however many positions it rests on."""
    passed, judged = record
    return passed / judged if judged > 0 else None


def fold(record: Sequence[float], passed: float, judged: float) -> list[float]:
    """A pair record with one more generation's verified draft positions folded in."""
    return [PAIR_DECAY * record[0] + passed, PAIR_DECAY * record[1] + judged]


def _record(path: Path | None) -> list[float] | None:
    try:
        return json.loads(path.read_text())["judged"] if path is not None else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_acceptance(path: Path | None) -> float | None:
    """The mean acceptance of the pair record at `path` (None: unknown)."""
    return None if (record := _record(path)) is None else mean_acceptance(record)


def save_acceptance(path: Path | None, passed: float, judged: float) -> None:
    """Fold one generation's verified draft positions into the pair's record."""
    if path is not None and judged > 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        record = fold(_record(path) or (0.0, 0.0), passed, judged)
        path.write_text(json.dumps({"judged": record, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}))


def time_forward(backend: Backend, ks: Sequence[int], repeats: int = 5,
                 progress: Callable[[int, int], None] | None = None, chunk: int | None = None,
                 context: int = CONTEXT_TOKENS) -> dict[int, float]:
    """Median ms of a k-token forward (all k logit rows) after `context` cached tokens, in
    forwards of at most `chunk` tokens."""
    n0 = max(1, min(context, backend.n_ctx - max(ks)))  # cached tokens (fewer in a tiny context)
    base = _timing_tokens(backend, n0 + max(ks))
    backend.truncate(0)
    backend.eval(base[:n0], rows="none")
    backend.checkpoint()
    backend.eval(base[n0:n0 + 1], rows="all")  # warm-up
    backend.truncate(n0)
    times: dict[int, list[float]] = {k: [] for k in ks}
    for r in range(repeats):
        for k in (ks if r % 2 == 0 else list(reversed(ks))):
            times[k].append(_forward_ms(backend, base, n0, k, chunk))
        if progress:
            progress(r + 1, repeats)
    backend.truncate(0)
    return {k: statistics.median(v) for k, v in times.items()}


def _timing_tokens(backend: Backend, n: int) -> list[int]:
    """n ordinary token ids to time forwards with (the same sequence every time)."""
    return [(7 * i + 11) % (min(backend.n_vocab, 1000) - 1) + 1 for i in range(n)]


def _forward_ms(backend: Backend, tokens: Sequence[int], at: int, k: int, chunk: int | None) -> float:
    """ms of a k-token forward (all rows) of tokens[at:at+k] after `at` cached ones, in forwards of
    at most `chunk` tokens; the cache is cut back to `at` afterwards (a recurrent one restores a
    checkpoint taken here, outside the timing)."""
    backend.checkpoint()
    t0 = time.perf_counter()
    for i in range(0, k, chunk or k):
        backend.eval(tokens[at + i:at + min(k, i + (chunk or k))], rows="all")
    ms = (time.perf_counter() - t0) * 1000
    backend.truncate(at)
    return ms


READ_TOKENS = 64  # a read long enough to show a batch's per-token cost (prompts are longer still)


def read_cost(backend: Backend, note: Callable[[str], None] | None = None) -> float:
    """ms per token when `backend` reads READ_TOKENS tokens in one forward (only the last row's
    logits), as a draft model catches up on a prompt or on tokens another drafter proposed: cached in
    the profile. Batched reads can cost anything from a few percent of a step per token (a GPU) to
    half of one (a quantized model on a small CPU), so the scheduler's guess is replaced by this."""
    path = profile_path(backend)
    prof = load_profile(path)
    if prof is not None and prof.read_ms is not None:
        return prof.read_ms
    if note:
        note(f"timing how fast {Path(backend.path).name} reads a prompt (once per model)")
    n = min(READ_TOKENS, backend.n_ctx - 1)
    tokens = _timing_tokens(backend, n)
    times = []
    for _ in range(2):  # the first read warms up; the quicker of two
        backend.truncate(0)
        t0 = time.perf_counter()
        backend.eval(tokens, rows="last")
        times.append((time.perf_counter() - t0) * 1000 / n)
    backend.truncate(0)
    save_profile(path, backend, read_ms=min(times))
    return min(times)


def _slow(backend: Backend) -> bool:
    """Whether a single step takes over SLOW_STEP_S (MLX on a small CPU): the quickest of three,
    so that one step slowed by another process does not count. Leaves the cache empty."""
    backend.truncate(0)
    step = []
    for i in range(3):
        t0 = time.perf_counter()
        backend.eval([1 + i], rows="last")
        step.append(time.perf_counter() - t0)
    backend.truncate(0)
    return min(step) > SLOW_STEP_S
