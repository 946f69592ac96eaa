"""The host path as it was before the batched one (edgespec/sampling.py and verify.py at d32baf2):
`process` one row at a time with a float64 softmax over the whole vocabulary, and
`verify_stochastic` built on it. Kept, unchanged, as the oracle the current implementation is
tested against (test_host_exactness.py). bench/host.py times the same code as its default "before"
column by reading d32baf2 from git."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from edgespec.sampling import SamplingParams, sample  # sample: unchanged since d32baf2

_NUCLEUS_PROBE = 512


def process(logits: npt.NDArray[np.floating], params: SamplingParams) -> npt.NDArray[np.float64]:
    """One row of logits (V,) → the processed probabilities (V,) float64 (the d32baf2 code)."""
    x = np.asarray(logits)
    n_vocab = x.shape[0]
    if params.greedy:
        p = np.zeros(n_vocab)
        p[int(np.argmax(x))] = 1.0
        return p
    keep: npt.NDArray[np.intp] | None = None
    if 0 < params.top_k < n_vocab:
        keep = np.argpartition(x, n_vocab - params.top_k)[n_vocab - params.top_k:]
        pk = x[keep].astype(np.float64)
    else:
        pk = x.astype(np.float64)
    pk -= pk.max()
    pk /= params.temperature
    np.exp(pk, out=pk)
    pk /= pk.sum()
    if params.top_p < 1.0:
        order = _nucleus_order(pk, params.top_p, x if keep is None else None)
        cdf = np.cumsum(pk[order])
        n_keep = int(np.searchsorted(cdf, params.top_p, side="left")) + 1
        sel = order[: min(n_keep, order.shape[0])]
        keep = sel if keep is None else keep[sel]
        pk = pk[sel]
    if params.min_p > 0.0:
        mask = pk >= params.min_p * pk.max()
        keep = np.flatnonzero(mask) if keep is None else keep[mask]
        pk = pk[mask]
    if keep is None:
        return pk
    p = np.zeros(n_vocab)
    p[keep] = pk / pk.sum()
    return p


def _nucleus_order(pk: npt.NDArray[np.float64], top_p: float,
                   key: npt.NDArray[np.floating] | None = None) -> npt.NDArray[np.intp]:
    n, m = pk.shape[0], _NUCLEUS_PROBE
    k = key if key is not None else pk
    while m < n:
        cand = np.argpartition(k, n - m)[n - m:]
        if pk[cand].sum() >= top_p:
            return cand[np.argsort(-pk[cand], kind="stable")]
        m *= 16
    return np.argsort(-pk, kind="stable")


def verify_stochastic(logits: npt.NDArray[np.floating], draft: Sequence[int], q: npt.NDArray[np.float64] | None,
                      params: SamplingParams, rng: np.random.Generator) -> tuple[int, int]:
    """Rejection sampling with rows processed one by one up to the first rejection (the d32baf2 code)."""
    for i, x in enumerate(draft):
        p = process(logits[i], params)
        q_x = 1.0 if q is None else float(q[i, x])
        if q_x > 0.0 and rng.random() * q_x < p[x]:
            continue
        if q is None:
            residual = p.copy()
            residual[x] = 0.0
        else:
            residual = np.maximum(p - q[i], 0.0)
        if residual.sum() <= 0.0:
            residual = p
        return i, sample(residual, rng)
    p = process(logits[len(draft)], params)
    return len(draft), sample(p, rng)
