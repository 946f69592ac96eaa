"""Gemma-4 assistant drafting: a separate small model that reads the target's KV cache and hidden state.

The wiring is llama.cpp's (llama-cpp-python 0.3.36 = ggml-org/llama.cpp@0c1e57098: common/speculative.cpp
``common_speculative_impl_draft_mtp`` with ``is_mem_shared``; src/models/gemma4-assistant.cpp;
src/llama-model.cpp's ``share``): the assistant (arch ``gemma4-assistant``) has no K/V projections of
its own; its layers attend over the target's KV cache of the target's last sliding-window and last
full-attention layers. It reads the target's token embeddings (scaled by √n_embd of the target) and a
hidden row of the target's width, and returns logits and the next such row (``post_projection``).

With the committed context c_0..c_{N-1} (c_{N-1} pending, the target holding 0..N-2), step 1 is the pair
(c_{N-1}, h_{N-2}) at position N-1 (the target's ``h_nextn`` row of the last evaluated token, its
post-final-norm hidden state); step i+1 is (x̃ᵢ, the assistant's own row from step i), at the SAME
position N-1 (upstream: "with shared memory we use the same position for all draft tokens"). The
assistant keeps no state between calls: nothing to sync, nothing to roll back.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from edgespec.backends.llama_mtp import LlamaAssistantContext, LlamaMtpTarget
from edgespec.drafters.base import Chain, Draft, DraftCost
from edgespec.errors import EdgespecError
from edgespec.sampling import SamplingParams


class AssistantDrafter:
    """Chain drafting with a Gemma-4 assistant on llama.cpp (greedy argmax, or sampled with q rows).

    Args:
        path: the assistant GGUF.
        target: the target, opened as a LlamaMtpTarget (it keeps the rows the assistant starts from).
        threads: the assistant context's CPU threads (default: the target's).
    """

    name = "assistant"

    def __init__(self, path: str | Path, target: LlamaMtpTarget, threads: int | None = None) -> None:
        if not isinstance(target, LlamaMtpTarget):
            raise EdgespecError(f"a Gemma-4 assistant needs its target opened with its hidden rows (LlamaMtpTarget); "
                                f"{type(target).__name__} {getattr(target, 'path', '?')} was not")
        self.target = target
        self.head = LlamaAssistantContext(path, target, threads=threads)
        self.paths = (str(path),)
        self._zero = np.zeros(target.n_embd, np.float32)

    def draft(self, context: Sequence[int], gamma: int, params: SamplingParams, rng: np.random.Generator,
              stop: Callable[[Sequence[float]], bool] | None = None) -> Draft:
        """Propose at most `gamma` tokens after `context` (see drafters.base.Drafter)."""
        n = len(context)
        if gamma <= 0 or n < 2:
            return Draft([])
        if self.target.n_past != n - 1:
            raise EdgespecError(f"the assistant drafts after the target's {n - 1} evaluated tokens, but the target "
                                f"holds {self.target.n_past}")
        logits, h = self.head.step(context[-1], self.target.hidden(n - 2, n - 1)[0])
        chain = Chain(params, rng, stop)
        while (x := chain.step(logits)) is not None and len(chain.tokens) < gamma:
            logits, h = self.head.step(x, h)
        return chain.draft(0)

    def cost_prior(self, note: Callable[[str], None] | None = None) -> DraftCost:
        """The scheduler's prior: one assistant step (median of up to 9, ~0.5 s at most) per drafted
        token, timed after one target token (what it attends to; rolled back)."""
        t = self.target
        n0 = t.n_past
        if n0 == 0:
            t.eval([t.bos_id if t.bos_id is not None else 0], rows="none")
        times: list[float] = []
        try:
            while len(times) < 9 and (len(times) < 3 or sum(times) < 0.5):
                t0 = time.perf_counter()
                logits, _ = self.head.step(0, self._zero)
                int(np.argmax(logits))
                times.append(time.perf_counter() - t0)
        finally:
            t.truncate(n0)
        return DraftCost(0.0, 1000 * statistics.median(times[1:]))

    def reset(self) -> None:
        """Nothing to forget: the assistant keeps no positions of its own."""

    def close(self) -> None:
        self.head.close()
