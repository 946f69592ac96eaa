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

    Each row's kept set is built only when the row is read, so verification never pays for rows
    after the first rejection. A restricted row costs one pass over its logits (the maxima of
    _GROUP-token blocks, `_Blocks`) and then reads only the members of a few blocks; no
    full-vocabulary sort, exp or mask. top-p's candidates are the blocks whose top weight is
    ≥ e^-τ, the mass outside bounded by _GROUP × the other blocks' top weights; a row that needs
    many blocks reads its tokens with z ≥ −_TAIL instead (the mass below bounded by their count ×
    e^-_TAIL), and a flat one bounds its denominator by its float32 softmax; top-k reads the
    blocks reaching the k-th largest block maximum; min-p those reaching z ≥ ln(min_p). Where a
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
        hit = (self.ids == x).nonzero()[0]
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
        self.top_k = params.top_k if 0 < params.top_k < x.shape[1] else 0
        self.restricted = bool(self.top_k) or params.top_p < 1.0 or params.min_p > 0.0

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
        x, params = self.x[r], self.params
        if self.greedy_ids is not None:
            return Dist(x.shape[0], self.greedy_ids[r:r + 1], _ONE)
        if not self.restricted:
            return _softmax(x, x.max(), params.temperature)
        if x.shape[0] < _GROUP:  # no whole block: every id is a candidate, as in each branch below
            return _kept(x, np.arange(x.shape[0]), float(x.max()), params)  # (the unit tests' tiny vocabularies)
        blocks = _Blocks(x)
        if self.top_k:
            row = _kept(x, blocks.top(self.top_k), blocks.m, params)
        elif params.top_p < 1.0:
            row = _nucleus(x, blocks, params)  # a peaked row: a few blocks decide it
            if row is None:  # a flatter one: the tokens near the top, each read
                row = _near_top(x, blocks.m, params)
            if row is None:  # flat, or its bulk left the cut undecided: the whole softmax bounds it closer
                if self._scratch is None:  # one buffer for every such row's weights
                    self._scratch = np.empty_like(x)
                row = _nucleus_of_flat_row(x, blocks.m, params, self._scratch)
        else:  # min-p alone: every kept token has z ≥ ln(min_p), so its block's maximum does too
            row = _kept(x, blocks.above(blocks.m + params.temperature * (np.log(params.min_p) - 1e-6)),
                        blocks.m, params)
        if row is None:  # still undecided: the whole vocabulary in float64 decides
            row = _kept(x, np.arange(x.shape[0]), blocks.m, params)
        assert row is not None
        return row


class _Blocks:
    """One row cut into _GROUP interleaved blocks, (_GROUP, V // _GROUP): block b holds ids
    b, b + n, b + 2n, … (n = V // _GROUP), and the ids past _GROUP·n are always candidates. One
    pass gives every block's maximum, so a set of tokens above a threshold is found from blocks
    (few, then only their members are read), and the weight left outside lies between the other
    blocks' top weights and _GROUP times them."""

    def __init__(self, x: npt.NDArray[np.floating]) -> None:
        n = self.n = x.shape[0] // _GROUP
        self.bm = x[: _GROUP * n].reshape(_GROUP, n).max(axis=0) if n else x[:0]  # (n,) block maxima
        self.rest = np.arange(_GROUP * n, x.shape[0])
        m = self.bm.max() if n else x.max()
        if n and self.rest.shape[0]:
            m = max(m, x[_GROUP * n:].max())
        self.m = float(m)  # the row's maximum

    def members(self, blocks: npt.NDArray[np.intp]) -> npt.NDArray[np.intp]:
        """Every id in `blocks`, and the ids past the blocks."""
        ids = (blocks + self.n * _OFFSETS).ravel()  # (_GROUP, len(blocks))
        return np.concatenate([ids, self.rest]) if self.rest.shape[0] else ids

    def above(self, floor: float) -> npt.NDArray[np.intp]:
        """Ids holding every token with logit ≥ floor (the members of blocks whose maximum is)."""
        return self.members((self.bm.astype(np.float64) >= floor).nonzero()[0])

    def top(self, k: int) -> npt.NDArray[np.intp]:
        """Ids holding the k largest logits: ≥ k blocks reach the k-th largest block maximum t, so
        the k-th largest logit is ≥ t and every logit above it lies in one of those blocks."""
        if k >= self.n:
            return np.arange(_GROUP * self.n + self.rest.shape[0])
        t = np.partition(self.bm, self.n - k)[self.n - k]
        return self.members((self.bm >= t).nonzero()[0])


def _nucleus(x: npt.NDArray[np.floating], blocks: _Blocks, params: SamplingParams) -> Dist | None:
    """top-p (then min-p) from the members of the blocks whose top weight e^z is ≥ e^-τ, for τ
    in _TAUS until the cut is decided: the other blocks' weight lies between the sum r of their
    top weights and _GROUP·r. None when more than _FEW_BLOCKS blocks (or 1/32 of them) would be
    needed (a flatter row: reading its tokens is then cheaper) or no τ decides it."""
    bm, t, eb = blocks.bm, blocks.bm.dtype.type, None
    for tau in _TAUS:
        sel = (bm >= t(blocks.m - params.temperature * tau)).nonzero()[0]
        if sel.shape[0] > min(_FEW_BLOCKS, blocks.n // 32):
            return None
        if eb is None:
            eb = bm - t(blocks.m)
            eb *= t(1 / params.temperature)
            np.exp(eb, out=eb)  # (n,) block top weights, max 1; the chosen blocks' are zeroed
        eb[sel] = 0.0
        # float32 weights are within 2⁻²³·(8 + 2|z|) < 3e-5 relative (|z| ≤ 104; below, e^z
        # underflows: < 1e-37 each), their pairwise sum within 2⁻²³·13
        r = float(eb.sum())
        lo, hi = r * (1 - 1e-4), _GROUP * (r * (1 + 1e-4) + blocks.n * 1e-37)
        row = _kept(x, blocks.members(sel), blocks.m, params, lo, hi)
        if row is not None:
            return row
    return None


def _near_top(x: npt.NDArray[np.floating], m: float, params: SamplingParams) -> Dist | None:
    """top-p (then min-p) from every token with z ≥ −_TAIL (or ≥ ln(min_p) when that is higher),
    the weight below bounded by their count × e^-tail. None when they are a large share of the
    row (flat) or the bound leaves the cut undecided."""
    tail = min(_TAIL, -np.log(params.min_p) + 1e-3) if params.min_p > 0.0 else _TAIL
    near = x >= x.dtype.type(m - params.temperature * (tail + 1e-3))  # (V,) the slack: float32 rounding
    if np.count_nonzero(near) > x.shape[0] // 16:
        return None
    ids = near.nonzero()[0]
    return _kept(x, ids, m, params, 0.0, (x.shape[0] - ids.shape[0]) * np.exp(-tail))


def _softmax(x: npt.NDArray[np.floating], m: np.floating, temperature: float,
             out: npt.NDArray[np.floating] | None = None) -> Dist:
    """The unrestricted softmax of one row, in the row's own precision (into `out` when given)."""
    w = np.subtract(x, m, out=out)
    w /= x.dtype.type(temperature)
    np.exp(w, out=w)
    return Dist(x.shape[0], None, w, float(w.sum()))  # pairwise: relative error ≤ 2⁻²³·18 in float32


def _kept(x: npt.NDArray[np.floating], ids: npt.NDArray[np.intp], m: float, params: SamplingParams,
          lo: float = 0.0, hi: float = 0.0) -> Dist | None:
    """The kept set of one row from candidate `ids`, which hold the top-k set when top-k is on,
    and otherwise leave out tokens of total weight in [lo, hi] (weights e^z, z = (logit − max)/T);
    None when where in that range it lies could change the nucleus. Order as plain sampling:
    temperature, top-k, top-p, min-p."""
    n_vocab = x.shape[0]
    e = np.subtract(x[ids], m, dtype=np.float64)
    e /= params.temperature
    np.exp(e, out=e)  # candidates' weights, max 1
    k = params.top_k if 0 < params.top_k < n_vocab else n_vocab
    if ids.shape[0] > k:
        top = e.argpartition(ids.shape[0] - k)[ids.shape[0] - k:]
        ids, e = ids[top], e[top]
    if params.top_p < 1.0:
        s = float(e.sum())
        z_lo, z_hi = s + lo, s + hi
        if hi > 0.0:  # a margin for the rounding of both sums
            z_lo, z_hi = z_lo * (1 - 1e-12), z_hi * (1 + 1e-12)
        head = _head(e, params.top_p * z_hi)  # candidates by descending weight, holding the nucleus
        if head is None:
            return None
        e = e[head]
        n = _cut(e.cumsum(), params.top_p * z_lo, params.top_p * z_hi)
        if n is None:
            return None
        ids, e = ids[head[:n]], e[:n]
    if params.min_p > 0.0:
        keep = e >= params.min_p  # e / e_max with e_max = 1 (the top token is always kept)
        ids, e = ids[keep], e[keep]
    return Dist(n_vocab, ids, e / e.sum())


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
    order = (-e).argsort(kind="stable")
    head, e = head[order], e[order]
    n = _cut(e.cumsum(), params.top_p * z_lo, params.top_p * z_hi)
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
    n = int(cum.searchsorted(lo, side="left")) + 1
    if n > cum.shape[0] or n != int(cum.searchsorted(hi, side="left")) + 1:
        return None
    return n


def _head(e: npt.NDArray[np.float64], mass: float) -> npt.NDArray[np.intp] | None:
    """Indices of the heaviest weights, sorted (descending, stable), that sum to at least `mass`:
    found under thresholds 1/64, 1/64², … of the top weight, so only the nucleus's neighbourhood
    is sorted, never the whole row. None if all of e holds less than `mass`."""
    t = 1 / 64
    while True:
        sel = (e >= t).nonzero()[0] if t > 0 else np.arange(e.shape[0])
        if e[sel].sum() >= mass:
            return sel[(-e[sel]).argsort(kind="stable")]
        if t == 0:
            return None
        t = t / 64 if t > 1e-12 else 0.0


_ONE = np.ones(1)
_GROUP = 32  # tokens per block (_Blocks): one pass finds the block maxima, 1/_GROUP as many as ids
# top-p's candidates: members of blocks with top weight ≥ e^-τ, for τ in turn until the cut is
# decided (the LM-like rows of bench/host.py: τ = 12 takes a few dozen blocks and decides most),
# while they are at most _FEW_BLOCKS blocks
_TAUS = (12.0, 13.5, 15.0)
_FEW_BLOCKS = 128
# Else the tokens with z ≥ −_TAIL: each token below weighs less than e^-20 ≈ 2e-9 of the top one,
# so 262k of them move the nucleus cut by < 6e-4 of the mass.
_TAIL = 20.0
_OFFSETS = np.arange(_GROUP)[:, None]  # (_GROUP, 1): block b's members are b + n·j
_BLOCK = 4096  # dense sampling finds the block first, then the id within it


def sample(probs: npt.NDArray[np.float64], rng: np.random.Generator) -> int:
    """Draw one id from a probability vector (need not be normalised; zero entries never drawn)."""
    cdf = probs.cumsum()
    i = int(cdf.searchsorted(rng.random() * cdf[-1], side="right"))
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
