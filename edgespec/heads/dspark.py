"""DSpark's Markov and confidence heads on top of a DFlash block (llama.cpp 0.3.36
src/models/dflash.cpp ``build_dspark_markov_head``, layout ``dflash.sample_from_anchor = false``).

Notation as in ``edgespec.heads.dflash``, R = the Markov rank. The block [x_a, MASK×(b−1)] at
positions a..a+b−1 gives base logits z_r (V, −inf outside d2t) and output-normed hiddens h_r;
row r = 1..b−1 drafts the token at position a+r, and prev_r is the token before it (prev_1 = x_a,
prev_r = the token drafted at row r−1):
  logits_r = z_r + scatter_d2t(w2 · w1[prev_r])                                   w1 (V, R), w2 (V_d, R)
  conf_r   = sigmoid(conf_w · [h_r ; w1[prev_r]] + conf_b)                        conf_w (1, H+R)
conf_r is the head's estimate that draft r is accepted given drafts 1..r−1 were. llama.cpp chains
prev_r = argmax(logits_{r−1}) inside its graph (greedy); edgespec's drafter passes the token it
actually drafted, so a sampled chain stays exact speculative sampling.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from edgespec.heads.dflash import DFlashConfig

F32 = npt.NDArray[np.float32]
MARKOV_W1 = "markov_w1.weight"  # a row per target token
MARKOV_TENSORS = (MARKOV_W1, "markov_w2.weight", "conf_proj.weight", "conf_proj.bias")


class MarkovHead:
    """The Markov bias and the confidence of a DSpark head.

    Args:
        config: a DFlashConfig with ``markov_rank`` > 0.
        tensors: GGUF tensor name → array holding at least ``markov_w1.weight``,
            ``markov_w2.weight``, ``conf_proj.*`` when ``config.has_confidence``, and ``d2t`` when
            V_d < V (checked by ``config.check_tensors`` where the whole head is loaded).
    """

    def __init__(self, config: DFlashConfig, tensors: Mapping[str, npt.NDArray]) -> None:
        if not config.markov_rank:
            raise ValueError("a DFlash head without markov_w1/markov_w2 has no Markov head")
        self.config = config
        self.w1 = np.asarray(tensors["markov_w1.weight"], np.float32)  # (V, R)
        self.w2 = np.asarray(tensors["markov_w2.weight"], np.float32)  # (V_d, R)
        self.d2t = np.asarray(tensors.get("d2t", np.arange(config.n_vocab)), np.int64)
        self.conf_w = self.conf_b = None
        if config.has_confidence:
            self.conf_w = np.asarray(tensors["conf_proj.weight"], np.float32)[0]  # (H + R,)
            self.conf_b = np.float32(np.asarray(tensors["conf_proj.bias"]).reshape(-1)[0])

    def bias(self, prev: int, old: int | None = None) -> F32:
        """w2 · w1[prev] on the draft vocabulary, (V_d,) float32; with `old`, w2 · (w1[prev] − w1[old])."""
        w1 = self.w1[int(prev)] if old is None else self.w1[int(prev)] - self.w1[int(old)]
        return (self.w2 @ w1).astype(np.float32)

    def apply(self, logits: F32, prev: int, sign: float = 1.0, old: int | None = None) -> F32:
        """One block row's logits (V,) plus the bias of `prev` (× `sign`: −1 removes it), scattered
        by d2t (−inf stays −inf). `old`: the row already carries old's bias, which is swapped for
        prev's in the same pass (the row itself, not a copy, when old == prev)."""
        if old is not None and int(old) == int(prev):
            return logits
        out = np.array(logits, np.float32)
        out[self.d2t] += np.float32(sign) * self.bias(prev, old)
        return out

    def confidence(self, h: F32, prev: int) -> float | None:
        """sigmoid(conf_w · [h ; w1[prev]] + conf_b) for one row's normed hidden h (H,); None
        without a confidence head."""
        if self.conf_w is None:
            return None
        H = self.config.n_embd
        x = float(self.conf_w[:H] @ np.asarray(h, np.float32)) + float(self.conf_w[H:] @ self.w1[int(prev)])
        return float(1.0 / (1.0 + np.exp(-(x + float(self.conf_b)))))
