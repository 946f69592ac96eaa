"""Logits → processed distribution, and sampling from it. Pure numpy.

The same `process` is applied to the target's rows (p) and the drafter's rows (q), so that
verification compares the distributions that plain decoding would actually sample from.
Order: temperature, top-k, top-p, min-p (min-p relative to the most likely token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from edgespec.errors import EdgespecError


class InvalidSamplingError(EdgespecError, ValueError):
    """A sampling parameter is outside its valid range."""


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. temperature == 0 means greedy (argmax of the raw logits)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off

    def __post_init__(self) -> None:
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidSamplingError(f"temperature must be >= 0 (got {self.temperature})")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise InvalidSamplingError(f"top_k must be an integer >= 0 (got {self.top_k})")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidSamplingError(f"top_p must be in (0, 1] (got {self.top_p})")
        if not (0.0 <= self.min_p < 1.0):
            raise InvalidSamplingError(f"min_p must be in [0, 1) (got {self.min_p})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def process(logits: npt.NDArray[np.floating], params: SamplingParams) -> npt.NDArray[np.float64]:
    """One row of logits (V,) → the probabilities (V,) float64 that sampling uses (zeros outside
    the kept set, sums to 1). Greedy params give the one-hot of the argmax. The dense form of
    `process_rows(logits[None], params)[0]`."""
    return process_rows(np.asarray(logits)[None], params)[0].dense()


def process_rows(logits: npt.NDArray[np.floating], params: SamplingParams) -> Rows:
    """Rows of logits (R, V) → their processed distributions, as a sequence of `Dist`.

    The row maxima and the candidate threshold are taken once over the 2-D array; each row's kept
    set is built only when the row is read, so verification never pays for rows after the first
    rejection. No full-vocabulary sort: top-p's candidates are the tokens within `_TAIL` of the
    row's maximum (z = (logit − max)/T ≥ −_TAIL), the mass below them bounded by their count ×
    e^-_TAIL; a row with much mass there (flat) bounds its denominator by its float32 softmax
    instead; top-k cuts where a sample of the row says; min-p needs only z ≥ ln(min_p). Where a
    bound leaves the nucleus undecided, the row is redone over the whole vocabulary in float64.

    Exactness (tests/test_host_exactness.py against the previous implementation): kept sets equal
    a float64 softmax's, and kept probabilities are computed in float64 from the row's logits.
    Only an unrestricted softmax of float32 logits (no top-k, top-p or min-p) stays in float32:
    each p_i is then within a relative 2⁻²³·(21 + |zᵢ|) of the float64 value (3 + |zᵢ| from the
    weight, 18 from the pairwise sum; ≤ 1.3e-5 for zᵢ ≥ −88, the float32 range), so sampling
    moves by < 2e-5 in total variation. float64 logits are processed in float64 throughout.
    """
    return Rows(np.asarray(logits), params)


class Dist:
    """A processed next-token distribution over `n_vocab` ids.

    Sparse when a kept set restricts it (`ids` and their `probs`, summing to 1), else dense
    (`ids` None, `probs` the (V,) unnormalised weights of the whole vocabulary, summing to `total`).
    `dist[x]` is p(x), so it reads like the dense row where only single entries are needed.
    """

    __slots__ = ("n_vocab", "ids", "probs", "total")

    def __init__(self, n_vocab: int, ids: npt.NDArray[np.intp] | None, probs: npt.NDArray[np.floating],
                 total: float = 1.0) -> None:
        self.n_vocab, self.ids, self.probs, self.total = n_vocab, ids, probs, total

    def __getitem__(self, x: int) -> float:
        if self.ids is None:
            return float(self.probs[x]) / self.total
        hit = np.flatnonzero(self.ids == x)
        return float(self.probs[hit[0]]) if hit.size else 0.0

    def dense(self) -> npt.NDArray[np.float64]:
        """The distribution as a (V,) float64 vector."""
        if self.ids is None:
            return self.probs.astype(np.float64) / self.total
        p = np.zeros(self.n_vocab)
        p[self.ids] = self.probs
        return p

    def sample(self, rng: np.random.Generator, exclude: int | None = None) -> int:
        """Draw one id; `exclude` (a rejected one-hot draft) is drawn with probability zero,
        unless it holds all the mass (then p itself is sampled, as the residual rule says)."""
        if self.ids is None:
            w = self.probs
            if exclude is not None and float(w[exclude]) < self.total:
                w = w.copy()
                w[exclude] = 0
            return sample_weights(w, rng)
        w = self.probs
        if exclude is not None:
            hit = self.ids == exclude
            if hit.any() and not hit.all():
                w = np.where(hit, 0.0, w)
        return int(self.ids[sample(w, rng)])


class Rows(Sequence[Dist]):
    """The processed rows of a (R, V) logits array, each built on first access (see process_rows)."""

    def __init__(self, x: npt.NDArray[np.floating], params: SamplingParams) -> None:
        self.x, self.params = x, params
        self._rows: list[Dist | None] = [None] * x.shape[0]
        self._scratch: npt.NDArray[np.floating] | None = None
        self.greedy_ids = np.argmax(x, axis=1) if params.greedy else None
        if params.greedy:
            return
        self.max = x.max(axis=1)  # (R,)
        self.top_k = params.top_k if 0 < params.top_k < x.shape[1] else 0
        self.restricted = bool(self.top_k) or params.top_p < 1.0 or params.min_p > 0.0
        if self.restricted and not self.top_k:  # (top-k finds its own candidates: _within_top)
            # a min-p set ends where p < min_p·p_max; a little slack keeps float32 rounding out of the cut
            self.tail = min(_TAIL, -np.log(params.min_p) + 1e-3) if params.min_p > 0.0 else _TAIL
            floor = (self.max - params.temperature * (self.tail + 1e-3)).astype(x.dtype)
            self.candidates = x >= floor[:, None]  # (R, V) bool

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, r):  # type: ignore[override]
        if isinstance(r, slice):
            return [self[i] for i in range(*r.indices(len(self)))]
        row = self._rows[r]
        if row is None:
            row = self._rows[r] = self._build(r)
        return row

    def _build(self, r: int) -> Dist:
        n_vocab = self.x.shape[1]
        if self.greedy_ids is not None:
            return Dist(n_vocab, self.greedy_ids[r:r + 1], _ONE)
        if not self.restricted:
            return _softmax(self.x[r], self.max[r], self.params.temperature)
        x, m, params = self.x[r], float(self.max[r]), self.params
        if self.top_k:  # the top-k set lies within a cut estimated from a sample of the row
            row = _kept(x, np.flatnonzero(_within_top(x, self.top_k)), m, np.inf, params)
        else:
            flat = params.top_p < 1.0 and np.count_nonzero(self.candidates[r]) > n_vocab // 16
            row = None if flat else _kept(x, np.flatnonzero(self.candidates[r]), m, self.tail, params)
            if row is None:  # flat, or its bulk left the cut undecided: the whole softmax bounds it closer
                if self._scratch is None:  # one buffer for every such row's weights
                    self._scratch = np.empty_like(x)
                row = _nucleus_of_flat_row(x, m, params, self._scratch)
        if row is None:  # still undecided: the whole vocabulary in float64 decides
            row = _kept(x, np.arange(n_vocab), m, np.inf, self.params)
        assert row is not None
        return row


def _softmax(x: npt.NDArray[np.floating], m: np.floating, temperature: float,
             out: npt.NDArray[np.floating] | None = None) -> Dist:
    """The unrestricted softmax of one row, in the row's own precision (into `out` when given)."""
    w = np.subtract(x, m, out=out)
    w /= x.dtype.type(temperature)
    np.exp(w, out=w)
    return Dist(x.shape[0], None, w, float(w.sum()))  # pairwise: relative error ≤ 2⁻²³·18 in float32


def _kept(x: npt.NDArray[np.floating], ids: npt.NDArray[np.intp], m: float, tail: float,
          params: SamplingParams) -> Dist | None:
    """The kept set of one row from candidate `ids`, which hold every token with weight
    e^z ≥ e^-tail (z = (logit − max)/T); None when the tokens outside could change the nucleus.
    Order as plain sampling: temperature, top-k, top-p, min-p."""
    n_vocab = x.shape[0]
    e = np.exp((x[ids].astype(np.float64) - m) / params.temperature)  # candidates' weights, max 1
    k = params.top_k if 0 < params.top_k < n_vocab else n_vocab
    if ids.shape[0] > k:
        top = np.argpartition(e, ids.shape[0] - k)[ids.shape[0] - k:]
        ids, e = ids[top], e[top]
    outside = k - ids.shape[0]  # members of the top-k set (or vocabulary) below the candidates
    if params.top_p < 1.0:
        z_lo = e.sum()
        z_hi = z_lo + outside * np.exp(-tail)
        head = _head(e, params.top_p * z_hi)  # candidates by descending weight, holding the nucleus
        if head is None:
            return None
        n = _cut(np.cumsum(e[head]), params.top_p * z_lo, params.top_p * z_hi)
        if n is None:
            return None
        ids, e = ids[head[:n]], e[head[:n]]
    elif outside > 0 and params.min_p <= 0.0 and k < n_vocab:
        return None  # top-k alone needs all k ids, and some lie below the candidates
    if params.min_p > 0.0:
        keep = e >= params.min_p  # e / e_max with e_max = 1 (the top token is always kept)
        ids, e = ids[keep], e[keep]
    return Dist(n_vocab, ids, e / e.sum())


def _within_top(x: npt.NDArray[np.floating], k: int) -> npt.NDArray[np.bool_]:
    """A mask holding the k largest logits and usually a few dozen more: cut where every
    _STRIDE-th logit, sorted, puts about 4·_STRIDE tokens above, lowered until it holds k."""
    s = -np.sort(-x[::_STRIDE])  # a sample of the row, descending
    j = k // _STRIDE + 4
    while j < s.shape[0]:
        mask = x >= s[j]
        if np.count_nonzero(mask) >= k:
            return mask
        j *= 4
    return np.ones(x.shape[0], dtype=bool)


def _nucleus_of_flat_row(x: npt.NDArray[np.floating], m: float, params: SamplingParams,
                         scratch: npt.NDArray[np.floating]) -> Dist | None:
    """top-p (then min-p) of a row with much of its mass in its bulk: the row's softmax in its own
    precision gives the denominator within a relative 2⁻²³·128 (float32: |error| of each weight ≤
    2⁻²³·(3 + |z|), |z| ≤ 104 before e^z underflows, and ≤ 2⁻²³·18 from the pairwise sum); the nucleus, found by it, is then cut with
    float64 weights. None when that bound leaves the cut undecided."""
    w = _softmax(x, x.dtype.type(m), params.temperature, out=scratch)
    eps = 0.0 if x.dtype == np.float64 else 2.0 ** -23 * 128
    z_lo, z_hi = w.total * (1 - eps), w.total * (1 + eps)
    head = _head(w.probs, params.top_p * z_hi)
    if head is None:
        return None
    e = np.exp((x[head].astype(np.float64) - m) / params.temperature)
    order = np.argsort(-e, kind="stable")
    head, e = head[order], e[order]
    n = _cut(np.cumsum(e), params.top_p * z_lo, params.top_p * z_hi)
    if n is None:
        return None
    ids, e = head[:n], e[:n]
    if params.min_p > 0.0:
        keep = e >= params.min_p
        ids, e = ids[keep], e[keep]
    return Dist(x.shape[0], ids, e / e.sum())


def _cut(cum: npt.NDArray[np.float64], lo: float, hi: float) -> int | None:
    """The nucleus size n (the first n weights reach the mass) for any mass in [lo, hi]; None when
    it depends on where in that range the mass lies, or when cum never reaches hi."""
    n = int(np.searchsorted(cum, lo, side="left")) + 1
    if n > cum.shape[0] or n != int(np.searchsorted(cum, hi, side="left")) + 1:
        return None
    return n


def _head(e: npt.NDArray[np.float64], mass: float) -> npt.NDArray[np.intp] | None:
    """Indices of the heaviest weights, sorted (descending, stable), that sum to at least `mass`:
    found under thresholds 1/64, 1/64², … of the top weight, so only the nucleus's neighbourhood
    is sorted, never the whole row. None if all of e holds less than `mass`."""
    t = 1 / 64
    while True:
        sel = np.flatnonzero(e >= t) if t > 0 else np.arange(e.shape[0])
        if e[sel].sum() >= mass:
            return sel[np.argsort(-e[sel], kind="stable")]
        if t == 0:
            return None
        t = t / 64 if t > 1e-12 else 0.0


_ONE = np.ones(1)
# A row's candidates: tokens with z = (logit − max)/T ≥ −_TAIL. Each token below weighs less than
# e^-20 ≈ 2e-9 of the top one, so 262k of them move the nucleus cut by < 6e-4 of the mass.
_TAIL = 20.0
_STRIDE = 32  # top-k estimates its cut from every _STRIDE-th logit
_BLOCK = 4096  # dense sampling finds the block first, then the id within it


def sample(probs: npt.NDArray[np.float64], rng: np.random.Generator) -> int:
    """Draw one id from a probability vector (need not be normalised; zero entries never drawn)."""
    cdf = np.cumsum(probs)
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return min(i, probs.shape[0] - 1)


def sample_weights(w: npt.NDArray[np.floating], rng: np.random.Generator) -> int:
    """Like `sample` for a long weight vector (V,), without a cumulative sum over all of it: the
    block sums (float64) pick a block of _BLOCK ids, the cumulative sum inside it picks the id."""
    n = w.shape[0]
    if n <= 2 * _BLOCK:
        return sample(w, rng)
    starts = np.arange(0, n, _BLOCK)
    cdf = np.cumsum(np.add.reduceat(w, starts, dtype=np.float64))
    u = rng.random() * cdf[-1]
    b = min(int(np.searchsorted(cdf, u, side="right")), starts.shape[0] - 1)
    while b > 0 and cdf[b] == cdf[b - 1]:  # an empty block: the draw landed on its edge
        b -= 1
    block = w[starts[b]: starts[b] + _BLOCK]
    inner = np.cumsum(block, dtype=np.float64)
    i = int(np.searchsorted(inner, u - (cdf[b - 1] if b else 0.0), side="right"))
    if i >= block.shape[0]:  # rounding between the two sums: the block's last id with weight
        i = int(np.flatnonzero(block)[-1])
    return int(starts[b]) + i
