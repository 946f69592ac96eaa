"""Greedy acceptance of a head the way drafting sees it, with the numpy reference head (no torch).

For every origin o in the part of a sequence the target generated itself (greedy), the head's cache
holds the real-feature entries of positions 0..o; it drafts x̃₁ = argmax of its row o, then goes on
from its own pre-norm h and its own drafted tokens (not the data's) up to ``depth`` tokens. Draft k
is accepted when x̃₁..x̃ₖ all equal the target's greedy tokens. This is what a γ = ``depth`` chain
drafter would get in greedy speculative decoding with this head, up to the features being the
cache's fp16 copies.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import numpy.typing as npt

from edgespec.heads.eagle3 import Eagle3Head
from edgespec.train.features import FeatureCache


def generated_start(tokens: npt.NDArray[np.int32], top1: npt.NDArray[np.int32]) -> int:
    """First position i such that every later token is the target's argmax of the row before it."""
    i = len(tokens) - 1
    while i > 0 and tokens[i] == top1[i - 1]:
        i -= 1
    return i


def chain_acceptance(head: Eagle3Head, files: Iterable[Path], depth: int = 5) -> dict[str, object]:
    """Acceptance by draft position (chained) over the generated parts of cached sequences.

    Returns:
        ``{"acceptance": [P(drafts 1..k all right) for k = 1..depth], "tau": mean accepted drafts
        + 1 at γ = depth, "origins": count}``.
    """
    accepted: list[int] = []
    for f in files:
        z = FeatureCache.load_file(f)
        tokens, top1 = z["tokens"].astype(np.int64), z["top_ids"][:, 0].astype(np.int64)
        n = len(tokens)
        start = max(generated_start(tokens, top1), 1)
        head.truncate(0)
        g = head.encode(z["feats"][:n - 1].astype(np.float32))
        logits, h = head.decode(tokens[1:].tolist(), g)  # row P: pair (t_{P+1}, g_P), predicts t_{P+2}
        full = head.kv_state()
        for o in range(start - 1, n - depth):  # context ends at t_{o+1}; drafts t_{o+2}..t_{o+1+depth}
            head.set_kv_state(full)
            head.truncate(o + 1)
            row, hid, right = logits[o], h[o:o + 1], 0
            for k in range(depth):
                if int(np.argmax(row)) != top1[o + 1 + k]:  # the target's greedy token t_{o+2+k}
                    break
                right += 1
                if k + 1 < depth:
                    nxt, hid = head.decode([int(np.argmax(row))], hid)
                    row = nxt[0]
            accepted.append(right)
        head.set_kv_state(full)
    a = np.asarray(accepted)
    acc = [float((a >= k).mean()) if len(a) else float("nan") for k in range(1, depth + 1)]
    return {"acceptance": acc, "tau": float(a.mean() + 1) if len(a) else float("nan"), "origins": len(a)}
