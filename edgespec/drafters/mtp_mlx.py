"""MTP drafting on MLX: the target's own multi-token-prediction block (Qwen3.5 / Qwen3.6) drafts γ tokens.

The pairing is llama.cpp's (vendored in llama-cpp-python 0.3.36, ``common/speculative.cpp``,
``common_speculative_impl_draft_mtp``), restated for edgespec's view of the context: the committed
context c_0..c_{N-1} (c_{N-1} is the pending token, not yet in the target's cache) fills MTP positions
p = 0..N-1 with the pairs (c_p, h_{p-1}), h_p being the target's hidden state at p AFTER its final norm
(qwen35.cpp's ``h_nextn``) and h_{-1} = 0 (llama.cpp's ``pending_h`` starts as zeros). The pair at N-1
predicts x̃₁; drafting on, position N-1+i takes (x̃ᵢ, the MTP's own output at the previous position) and
predicts x̃ᵢ₊₁. Draft positions are never kept: the next call syncs the MTP's KV cache to its context by
common prefix (as EagleDrafter does) and redoes the pairs from the target's fresh hidden states.

The target is any MlxBackend (no special class): ``FinalHiddenTap`` wraps its text model's final
``norm`` module and records the output of every forward pass, keyed by the position the forward started
at, so chunked prompts, rejected verifications and a recurrent target's checkpoint replay (Qwen3.5 is a
Gated-DeltaNet hybrid: ``truncate`` re-evaluates from the checkpoint) all leave row p = h_p.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from edgespec.backends.llama_features import FeatureStore
from edgespec.backends.mlx_hidden import tap_class
from edgespec.drafters.base import Chain, Draft, DraftCost, common_prefix
from edgespec.errors import EdgespecError, ModelLoadError
from edgespec.heads.mtp_mlx import MlxMtpHead, check_weights, load_mtp_weights, target_embed_head
from edgespec.sampling import SamplingParams

F32 = npt.NDArray[np.float32]


class FinalHiddenTap:
    """The post-final-norm hidden state of every position an MlxBackend evaluates.

    Installed on ``target.model.model.norm``; ``rows(start, stop)`` → (stop - start, H) float32.
    """

    def __init__(self, target: Any) -> None:
        self.target = target
        self.body = body = target.model.model
        if "norm" not in body or not isinstance(getattr(body, "layers", None), list):
            raise ModelLoadError(f"model type {target.model_type!r} has no final norm to read MTP hidden states from")
        self.n_embd = int(body.norm.weight.shape[-1])
        self._store = FeatureStore(self.n_embd)
        self._pending: list[tuple[int, Any]] = []
        self._inner = body.norm
        body.norm = tap_class()(body.norm, self._record)

    def _record(self, h: Any) -> None:
        # called inside the target's forward, before it counts the chunk: n_past is where it starts
        self._pending.append((self.target.n_past, h))

    def rows(self, start: int, stop: int) -> F32:
        mx = self.target._mx
        for at, h in self._pending:  # lazily computed by the forward; gathered here in order
            h32 = h[0].astype(mx.float32)
            mx.eval(h32)
            self._store.truncate(at)
            self._store.append(np.asarray(h32))
        self._pending.clear()
        if stop > self.target.n_past:
            raise EdgespecError(f"MTP needs target hidden states up to position {stop - 1}, "
                                f"but the target has evaluated {self.target.n_past}")
        return self._store.rows(start, stop)

    def detach(self) -> None:
        if "norm" in self.body and self.body.norm is not self._inner:
            self.body.norm = self._inner
        self._pending.clear()


class MlxMtpDrafter:
    """γ draft tokens from the target's own MTP block, on MLX (Drafter protocol, drafters.base).

    Args:
        target: the opened MlxBackend target (a Qwen3.5 / Qwen3.6 model; mlx-lm's ``qwen3_5``).
        source: where the MTP weights are: a GGUF with ``nextn`` tensors or an HF checkpoint directory
            with ``mtp.*`` tensors; default the path the target was opened from.
    """

    name = "mtp"

    def __init__(self, target: Any, source: str | Path | None = None) -> None:
        from edgespec.backends.mlx import MlxBackend

        if not isinstance(target, MlxBackend):
            raise EdgespecError(f"the MLX mtp drafter needs an MLX target; {type(target).__name__} "
                                f"{getattr(target, 'path', '?')} is not one")
        src = Path(source if source is not None else target.path).expanduser()
        weights = load_mtp_weights(src)
        self.tap = FinalHiddenTap(target)
        try:
            check_weights(weights, target.n_vocab, self.tap.n_embd)
            embed, head = target_embed_head(target.model)
            self.head = MlxMtpHead(weights, embed, head)
        except BaseException:
            self.tap.detach()
            raise
        self.target = target
        self.paths = (str(src),)
        self._ctx: list[int] = []  # the context whose pairs fill MTP positions 0..len-1
        self._synced = 0

    def sync(self, context: Sequence[int]) -> tuple[F32, F32] | None:
        """Bring the MTP's KV cache to `context` (positions 0..N-1) and return the logits (V,) and
        output (1, H) of the last pair: the MTP's distribution of the token after `context`."""
        n = len(context)
        if n < 1:
            return None
        if self.target.n_past < n - 1:
            raise EdgespecError(f"the MTP drafter needs target hidden states of the {n - 1} context tokens "
                                f"before the last, but the target has evaluated {self.target.n_past}")
        common = common_prefix(self._ctx, context)
        n_keep = max(0, min(common, n - 1, len(self._ctx), self.head.n_past))  # the last pair is redone
        self.head.truncate(n_keep)
        h = self.tap.rows(max(0, n_keep - 1), n - 1)
        if n_keep == 0:
            h = np.concatenate([np.zeros((1, self.tap.n_embd), np.float32), h])
        logits, out = self.head.decode(context[n_keep:], h, rows="last")
        self._ctx = list(context)
        self._synced = n - 1 - n_keep
        return logits[0], out

    def draft(self, context: Sequence[int], gamma: int, params: SamplingParams, rng: np.random.Generator,
              stop: Callable[[Sequence[float]], bool] | None = None) -> Draft:
        """Propose at most `gamma` tokens after `context` (see drafters.base.Drafter)."""
        first = self.sync(context) if gamma > 0 else None
        if first is None:
            return Draft([])
        logits, h = first
        chain = Chain(params, rng, stop)
        while (x := chain.step(logits)) is not None and len(chain.tokens) < gamma:
            out, h = self.head.decode([x], h)
            logits = out[0]
        return chain.draft(self._synced)

    def measure_ms(self, k: int, repeats: int = 8) -> float:
        """Median ms of one MTP forward of `k` pairs and its argmax, on scratch positions rolled back."""
        self.reset()
        h = np.zeros((k, self.tap.n_embd), np.float32)
        times = []
        try:
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                logits, _ = self.head.decode([0] * k, h, rows="last")
                int(np.argmax(logits[0]))
                times.append(time.perf_counter() - t0)
                self.head.truncate(0)
        finally:
            self.reset()
        return 1000 * statistics.median(times[1:])  # the first call warms caches

    def cost_prior(self, note: Callable[[str], None] | None = None) -> DraftCost:
        """As drafters.mtp.MtpDrafter's: T(1) per drafted token, and once per cycle T(2) − T(1) for the
        pairs the target confirmed, which the first step evaluates with the pending token's."""
        t1, t2 = self.measure_ms(1), self.measure_ms(2)
        return DraftCost(max(0.0, t2 - t1), t1)

    def reset(self) -> None:
        self._ctx = []
        self.head.truncate(0)

    def close(self) -> None:
        self.tap.detach()
        self.head.close()


def check_mlx_mtp_target(path: str | Path) -> None:
    """Plan-time check of ``--drafter mtp --backend mlx``: one-line ModelLoadError unless `path` (a GGUF or
    an HF / mlx-lm directory) holds a dense Qwen3.5 MTP block. Reads the header or the safetensors index
    only (no weights)."""
    p = Path(path).expanduser()
    if p.is_dir():
        from edgespec.heads.mtp_mlx import hf_mtp_names

        if "mtp.fc.weight" not in hf_mtp_names(p):
            raise ModelLoadError(f"--drafter mtp: {p} has no MTP layers (no mtp.* tensors; mlx-lm's converted "
                                 "directories drop them: use the HF checkpoint or the GGUF)")
        return
    from edgespec.gguf_file import read_gguf

    g = read_gguf(p, keep_key=lambda k: k == "general.architecture" or k.endswith(".nextn_predict_layers"),
                  with_tensors=False)
    arch = g.value("general.architecture")
    key = f"{arch}.nextn_predict_layers"
    if not g.value(key, 0):
        raise ModelLoadError(f"--drafter mtp: {p} (architecture {arch}) has no MTP layers ({key} is absent or 0)")
    if arch != "qwen35":
        raise ModelLoadError(f"--drafter mtp on MLX drafts with dense Qwen3.5 MTP blocks (qwen35), not {arch}'s ({p})")
