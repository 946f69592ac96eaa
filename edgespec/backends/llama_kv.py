"""KV handoff: a draft model that is a quantized copy of the target reads the target's KV cache
instead of evaluating the context itself.

On this CPU a Q4 draft model is compute-bound: it reads a prompt at ~4.7 ms per token (SmolLM2-135M
Q4_1, 2 threads) while the F32 target it drafts for prefills at ~2.7, so a draft model paid ~1.5 s
for a 324-token prompt before its first draft, more than most replies could win back. The target
has already computed those positions. When both are the same model (same architecture, same shapes,
same KV cache type), the target's cells are a stand-in for the drafter's own: the attention layers
read K and V rows of the same size, computed from weights the drafter's approximate. Copying a
sequence's cells is llama.cpp's own state API (`llama_state_seq_get_data` / `llama_state_seq_set_data`,
llama-context.cpp / llama-kv-cache.cpp `state_write` / `state_read`, which refuse a different layer
count, type or row size): ~11 µs per context token here, against ~4.7 ms to evaluate it.

Whether the stand-in is good is measured where there is reason to doubt it (`KvHandoff.probe`): on
a fixed text the drafter predicts the second half with its own cache and with the target's, and the
handoff is used only if it agrees with the target's argmax about as often (a different model of the
same shapes would draft worse from cells it did not compute). The probe costs ~1 s (SmolLM2 F32 +
Q4_1 here), ~40 % of a first 128-token generation, and a quantized copy always passed it (98–99 of
100 positions either way), so a pair never seen is trusted on its shapes, only its costs timed
(`time_costs`); a pair whose drafts were then seldom right probes at its next open
(drafters.draft_model.open_kv_handoff keeps the verdict and costs per pair). Like any drafter detail
it can change the speed, never the output: verification decides every token.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence

import numpy as np

from edgespec.backends.llama_cpp import LlamaCppBackend

# metadata that must agree for the target's cells to fit the drafter's layers ({arch} filled in)
SHAPE_KEYS = ("general.architecture", "{arch}.block_count", "{arch}.embedding_length",
              "{arch}.attention.head_count", "{arch}.attention.head_count_kv", "{arch}.attention.key_length",
              "{arch}.attention.value_length", "{arch}.rope.freq_base", "{arch}.attention.sliding_window",
              "{arch}.rope.dimension_count")
# the probe: public-domain prose (the opening of Jerome K. Jerome, "Three Men in a Boat", 1889)
PROBE_TEXT = ("There were four of us - George, and William Samuel Harris, and myself, and Montmorency. We were "
              "sitting in my room, smoking, and talking about how bad we were - bad from a medical point of "
              "view I mean, of course. We were all feeling seedy, and we were getting quite nervous about it. "
              "Harris said he felt such extraordinary fits of giddiness come over him at times, that he hardly "
              "knew what he was doing; and then George said that he had fits of giddiness too.")
PROBE_SLACK = 0.1  # the handoff may agree with the target on this share of probe positions fewer
COST_TOKENS = 16  # tokens a trusted handoff's copy and the drafter's read are timed on


def shapes_match(target: LlamaCppBackend, drafter: LlamaCppBackend) -> bool:
    """Same architecture, layer and head shapes, KV cache type, and neither recurrent."""
    if target.recurrent or drafter.recurrent or target.kv_type != drafter.kv_type:
        return False
    arch = target.metadata("general.architecture")
    return arch is not None and all(
        target.metadata(k.format(arch=arch)) == drafter.metadata(k.format(arch=arch)) for k in SHAPE_KEYS)


def worth_handing(target_ids: Sequence[int], own: Sequence[int], handed: Sequence[int]) -> bool:
    """Use the handoff when the drafter's predictions from the target's cells agree with the
    target about as often as those from its own (within PROBE_SLACK of the positions)."""
    t = np.asarray(target_ids)
    agree_own, agree_handed = int((np.asarray(own) == t).sum()), int((np.asarray(handed) == t).sum())
    return agree_handed >= agree_own - PROBE_SLACK * len(t)


def open_handoff(target: object, drafter: object, probe: bool = True,
                 costs: tuple[float, float] | None = None) -> KvHandoff | None:
    """A handoff from `target` to `drafter` (None: not llama.cpp on both sides, shapes that differ, or
    a probe that says the drafter drafts worse from the target's cells). `costs` (ms per copied
    token, ms per read token) are what an earlier open measured: nothing is timed then. Without
    `probe` the handoff is trusted on its shapes and only its costs are timed (`time_costs`, ~0.1 s
    where the probe takes ~1 s): the caller decides when a pair's record gives reason to doubt it."""
    # a target subclass (MTP, features) keeps more than one sequence's cells in its own way
    if type(target) is not LlamaCppBackend or not isinstance(drafter, LlamaCppBackend):
        return None
    if not shapes_match(target, drafter):
        return None
    h = KvHandoff(target, drafter)
    if costs is not None:
        h.ms_per_token, h.read_ms = costs
        return h
    tokens = target.tokenize(PROBE_TEXT)
    if not probe:
        return h if h.time_costs(tokens[:COST_TOKENS]) else None
    return h if len(tokens) >= 8 and h.probe(tokens) else None


class KvHandoff:
    """Copies the target's sequence into the drafter's cache (`copy`); `open_handoff` makes one only
    where `probe` says it pays."""

    def __init__(self, target: LlamaCppBackend, drafter: LlamaCppBackend) -> None:
        self.target, self.drafter = target, drafter
        self.ms_per_token = 0.0  # what a copy costs per context token (measured by probe)
        self.read_ms = 0.0  # what the drafter pays per token to evaluate them (probe; then cost_prior's)
        self._buf = np.empty(0, np.uint8)

    def copy(self) -> bool:
        """Give the drafter the target's cache: all n_past cells (False, and the drafter emptied, if
        llama.cpp refused them)."""
        src, dst = self.target, self.drafter
        ll = src._ll
        size = ll.llama_state_seq_get_size(src._ctx, 0)
        if size > len(self._buf):
            self._buf = np.empty(size, np.uint8)
        ptr = self._buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        n = ll.llama_state_seq_get_data(src._ctx, ptr, size, 0)
        if n and ll.llama_state_seq_set_data(dst._ctx, ptr, n, 0) == n:
            dst._n_past = src.n_past  # the drafter's cache now holds the target's positions
            return True
        dst._drop_all()  # whatever the failed restore left
        return False

    def time_costs(self, tokens: Sequence[int]) -> bool:
        """Time what a copy costs per token and what the drafter pays per token to read `tokens`
        itself (after a one-token warm-up of its fresh context); False if llama.cpp refused the
        cells. Leaves both caches empty."""
        src, dst, n = self.target, self.drafter, len(tokens)
        try:
            src.truncate(0)
            src.eval(tokens, rows="none")
            dst.truncate(0)
            dst.eval(tokens[:1], rows="last")
            dst.truncate(0)
            t0 = time.perf_counter()
            dst.eval(tokens, rows="last")
            self.read_ms = (time.perf_counter() - t0) * 1000 / n
            dst.truncate(0)
            t0 = time.perf_counter()
            ok = self.copy()
            self.ms_per_token = (time.perf_counter() - t0) * 1000 / n
            return ok
        finally:
            src.truncate(0)
            dst.truncate(0)

    def probe(self, tokens: Sequence[int]) -> bool:
        """Whether the handoff pays, on `tokens`: the target's argmax at each position of the second half,
        against the drafter's from its own cache and from the target's cells for the first half;
        times the copy. Leaves both caches empty."""
        src, dst, half = self.target, self.drafter, len(tokens) // 2
        try:
            src.truncate(0)
            target_ids = src.eval_argmax(tokens)[half:]
            dst.truncate(0)
            t0 = time.perf_counter()
            own = dst.eval_argmax(tokens)[half:]
            self.read_ms = (time.perf_counter() - t0) * 1000 / len(tokens)
            src.truncate(half)
            dst.truncate(0)
            t0 = time.perf_counter()
            if not self.copy():
                return False
            self.ms_per_token = (time.perf_counter() - t0) * 1000 / half
            handed = dst.eval_argmax(tokens[half:])  # the same positions, from the target's first half
            return worth_handing(target_ids, own, handed)
        finally:
            src.truncate(0)
            dst.truncate(0)
