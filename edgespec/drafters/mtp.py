"""MTP drafting: the target's own multi-token-prediction ("nextn") layers draft γ tokens.

The pairing is llama.cpp's (common/speculative.cpp ``common_speculative_impl_draft_mtp``, llama-cpp-python
0.3.36 = ggml-org/llama.cpp@0c1e57098), restated for edgespec's view of the context. The committed
context is c_0..c_{N-1}; c_{N-1} is the pending token, not yet in the target's KV cache, and the
target holds h_0..h_{N-2}, h_p being its ``h_nextn`` row at p (src/models/qwen35.cpp: the last trunk
layer's output after ``output_norm``; backends/llama_mtp.LlamaMtpTarget keeps them). MTP position p
holds the pair (c_p, h_{p-1}), position 0 the pair (c_0, zeros) (upstream's ``pending_h`` starts at
zero). The pair at N-1 predicts x̃₁. Drafting on, position N-1+i takes (x̃ᵢ, the MTP head's own
``h_nextn`` at the previous position) and predicts x̃ᵢ₊₁ (upstream's ``draft()``).

Upstream feeds every target batch into the draft context as it is verified (``process()``), then
drafts from the pending token in a second forward. Here the draft context is synced to each call's
context by common prefix, as DraftModelDrafter and EagleDrafter are: the pairs the target has
confirmed since the last call AND the pending token's pair go in ONE forward, whose last row starts
the chain. Draft positions (paired with the head's own rows) are never kept: the next call cuts
them (``truncate``) before syncing, so partial rejection, full acceptance, a recurrent target's
rollback and new prompts need no special case.

Confidence: the top probability of the head's raw softmax when greedy, of q when sampling (base.Chain).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

from edgespec.backends.llama_mtp import LlamaMtpContext, LlamaMtpTarget
from edgespec.drafters.base import Chain, Draft, DraftCost, common_prefix
from edgespec.errors import EdgespecError
from edgespec.sampling import SamplingParams


class MtpDrafter:
    """Chain drafting with the target's MTP head on llama.cpp (greedy: argmax; sampled: draws from the
    processed head distribution and returns its q rows).

    Args:
        target: the target, opened as a LlamaMtpTarget (its nextn rows are what the head reads).
        threads: the draft context's CPU threads (default: the target's).

    ``paths`` is the target's file: the scheduler remembers this pair's acceptance under it.
    """

    name = "mtp"

    def __init__(self, target: LlamaMtpTarget, threads: int | None = None) -> None:
        if not isinstance(target, LlamaMtpTarget):
            raise EdgespecError(f"--drafter mtp needs its target opened with its MTP layers (LlamaMtpTarget); "
                                f"{type(target).__name__} {getattr(target, 'path', '?')} was not")
        self.target = target
        self.head = LlamaMtpContext(target, threads=threads)
        self.paths = (target.path,)
        self._kv: list[int] = []  # the context whose pairs fill the head's positions 0..len-1
        self._zero = np.zeros((1, target.n_embd), np.float32)

    def sync(self, context: Sequence[int]) -> tuple[np.ndarray, np.ndarray, int]:
        """Bring the head's KV cache to `context`'s pairs and return the last pair's logits (V,), its
        h (n_embd,), and how many pairs beyond that one were evaluated."""
        n = len(context)
        if self.target.n_past < n - 1:
            raise EdgespecError(f"the mtp drafter needs the target's hidden rows of the {n - 1} context tokens "
                                f"before the last, but the target has evaluated {self.target.n_past}")
        keep = min(common_prefix(self._kv, context), n - 1)  # the last pair is redone for its logits
        self.head.truncate(keep)  # also drops the previous call's draft positions
        self._kv = list(context[:keep])
        h = self.target.hidden(max(0, keep - 1), n - 1)  # h_{p-1} for p in keep..n-1
        if keep == 0:
            h = np.concatenate([self._zero, h])
        out = None
        for start in range(keep, n, self.head.n_batch):  # a long prompt in batches
            stop = min(n, start + self.head.n_batch)
            out = self.head.decode(list(context[start:stop]), h[start - keep:stop - keep])
            self._kv.extend(context[start:stop])
        assert out is not None
        return out[0], out[1], n - 1 - keep

    def draft(self, context: Sequence[int], gamma: int, params: SamplingParams, rng: np.random.Generator,
              stop: Callable[[Sequence[float]], bool] | None = None) -> Draft:
        """Propose at most `gamma` tokens after `context` (see drafters.base.Drafter)."""
        if gamma <= 0 or not context:
            return Draft([])
        logits, h, synced = self.sync(context)
        chain = Chain(params, rng, stop)
        room = self.target.n_ctx - self.head.n_past
        while (x := chain.step(logits)) is not None and len(chain.tokens) < min(gamma, room + 1):
            logits, h = self.head.decode([x], h[None])
        return chain.draft(synced)

    def measure_ms(self, k: int, repeats: int = 8, budget_s: float = 0.5) -> float:
        """Median ms of one head forward of `k` pairs and its argmax, on scratch positions rolled back
        (at most `repeats` timed calls, fewer once `budget_s` is spent: a large LM head is slow)."""
        self.reset()
        h = np.zeros((k, self.target.n_embd), np.float32)
        times: list[float] = []
        try:
            while len(times) < repeats + 1 and (len(times) < 3 or sum(times) < budget_s):
                t0 = time.perf_counter()
                logits, _ = self.head.decode([0] * k, h)
                int(np.argmax(logits))
                times.append(time.perf_counter() - t0)
                self.head.truncate(0)
        finally:
            self.reset()
        return 1000 * statistics.median(times[1:])  # the first call warms caches

    def cost_prior(self, note: Callable[[str], None] | None = None) -> DraftCost:
        """The scheduler's prior: T(1) of the head per drafted token, and once per cycle T(2) − T(1)
        more, for the pairs the target confirmed that the first step reads with the pending token
        (timed at each load, in about a second at most)."""
        if note is not None:
            note("timing the MTP head's draft step")
        t1, t2 = self.measure_ms(1), self.measure_ms(2)
        return DraftCost(max(0.0, t2 - t1), t1)

    def reset(self) -> None:
        """Forget the head's cached context."""
        self._kv = []
        self.head.truncate(0)

    def close(self) -> None:
        self.head.close()
