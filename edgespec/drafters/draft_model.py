"""A same-vocabulary draft model on its own backend context."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from edgespec.backends.base import Backend
from edgespec.drafters.base import Draft, DraftCost, confidence, reusable_prefix
from edgespec.drafters.tree_draft import side_tree
from edgespec.errors import ContextOverflowError, VocabMismatchError
from edgespec.sampling import SamplingParams, process_rows, sample
from edgespec.tree import DraftTree

if TYPE_CHECKING:
    from edgespec.backends.llama_kv import KvHandoff

# llama.cpp common/speculative.cpp: vocab sizes may differ by this much; token texts are compared
# from this id on (ids below are control tokens that models number differently).
VOCAB_MAX_SIZE_DIFFERENCE = 128
DRAFT_CONTEXT = 16  # cached tokens a draft model's T(1) and T(2) are timed after (its cost prior) ...
DRAFT_REPEATS = 5  # ... in this many alternating repeats (fewer spread the prior more: docs/experiments/
# bandwidth-regime.md, "The first generation")
VOCAB_CHECK_START_TOKEN_ID = 5
_RANK = SamplingParams(temperature=1.0)  # greedy trees rank a position's alternatives by its softmax
_VOCAB_TYPES = {1: "SPM", 2: "BPE", 3: "WPM", 4: "UGM", 5: "RWKV", 6: "PLaMo-2"}  # llama_vocab_type


def check_vocab_compatible(target: Backend, drafter: Backend) -> None:
    """Raise VocabMismatchError, naming both models and the first differing token, unless the
    drafter can draft for the target under llama.cpp's rule. A pair of files found compatible once
    is not compared again (token by token through ctypes: 0.5 s for Gemma-3's 262k tokens here)."""
    from edgespec import calibration

    known = calibration.vocab_path(target, drafter)
    if known is not None and known.is_file():
        return
    _compare_vocabs(target, drafter)
    if known is not None:
        known.parent.mkdir(parents=True, exist_ok=True)
        known.write_text("compatible\n")


def _compare_vocabs(target: Backend, drafter: Backend) -> None:
    t, d = target.vocab_fingerprint(), drafter.vocab_fingerprint()
    problem = None
    if t.vocab_type != d.vocab_type:
        kinds = [_VOCAB_TYPES.get(v.vocab_type, str(v.vocab_type)) for v in (d, t)]
        problem = f"tokenizer types differ ({kinds[0]} vs {kinds[1]})"
    elif t.add_bos != d.add_bos or (t.add_bos and t.bos_id != d.bos_id):
        problem = f"BOS differs (id {d.bos_id} vs {t.bos_id})"
    elif t.add_eos != d.add_eos or (t.add_eos and t.eos_id != d.eos_id):
        problem = f"EOS differs (id {d.eos_id} vs {t.eos_id})"
    elif abs(t.n_vocab - d.n_vocab) > VOCAB_MAX_SIZE_DIFFERENCE:
        problem = f"sizes differ by more than {VOCAB_MAX_SIZE_DIFFERENCE} ({d.n_vocab} vs {t.n_vocab} tokens)"
    first = next((i for i in range(VOCAB_CHECK_START_TOKEN_ID, min(t.n_vocab, d.n_vocab))
                  if t.token_text(i) != d.token_text(i)), None)
    if problem is None and first is None:
        return
    where = (f"first differing token {first}: {d.token_text(first)!r} vs {t.token_text(first)!r}"
             if first is not None else "token texts agree")
    raise VocabMismatchError(
        f"drafter {drafter.path} cannot draft for target {target.path}: vocabularies differ "
        f"({problem or 'token texts differ'}; {where})")


class DraftModelDrafter:
    """Samples γ tokens from a smaller model with the same vocabulary and keeps their q rows.

    Its KV cache is synced to the context by common prefix on every call, so partial acceptance,
    full acceptance (last draft + bonus token both new to it) and new prompts need no special cases.
    With a `handoff` (a quantized copy of the target on llama.cpp: backends.llama_kv) it takes the
    target's cells for what it missed when copying them costs less than evaluating them.
    """

    name = "draft-model"
    sampled_trees = True  # side_tree: side trees (drafters.base.prices_sampled_trees)

    def __init__(self, model: Backend, n_vocab_target: int, handoff: KvHandoff | None = None) -> None:
        self.model = model
        self.n_vocab = n_vocab_target
        self.paths = (model.path,)
        self.handoff = handoff
        self._kv: list[int] = []  # tokens in the draft model's KV cache
        self._dists: list[np.ndarray] | None = None  # greedy draft_tree: each position's softmax, kept

    def draft(self, context: Sequence[int], gamma: int, params: SamplingParams, rng: np.random.Generator,
              stop: Callable[[Sequence[float]], bool] | None = None) -> Draft:
        # keep ≥ 1 token to evaluate for fresh logits
        n_keep = reusable_prefix(self._kv, context[:-1], self.model)
        synced = len(context) - 1 - n_keep  # context tokens it missed (the last one is fed anyway)
        copied = 0
        if synced > 1 and self._handed(synced, len(context) - 1):
            n_keep = copied = len(context) - 1
        else:  # (a refused copy left the model empty)
            n_keep = min(n_keep, self.model.n_past)
            self.model.truncate(n_keep)
        self._kv = list(context[:n_keep])
        tokens, rows, conf = [], [], []
        feed = list(context[n_keep:])
        try:
            while len(tokens) < gamma:
                logits = self.model.eval(feed, rows="last")[0]
                self._kv.extend(feed)
                if len(tokens) == 0:  # the next cycle keeps at least the context drafted from
                    self.model.checkpoint()
                if params.greedy:  # q is one-hot: no row is built, the argmax among the target's ids
                    conf.append(confidence(logits, None))
                    x = int(logits[:self.n_vocab].argmax())
                    if self._dists is not None:
                        self._dists.append(_fit(process_rows(logits[None], _RANK)[0].dense(), self.n_vocab))
                else:
                    p = process_rows(logits[None], params)[0]
                    q = _fit(p.dense(), self.n_vocab)  # (V_target,)
                    conf.append(confidence(logits, q))
                if stop is not None and stop(conf):
                    conf.pop()
                    break
                if not params.greedy:  # q is p itself unless the vocabularies differ in size: then draw from q
                    x = p.sample(rng) if q.shape[0] == p.n_vocab else sample(q, rng)
                    rows.append(q)
                tokens.append(x)
                feed = [x]
        except ContextOverflowError:
            pass  # draft what fits; the target checks the context limit itself
        return Draft(tokens, np.stack(rows) if rows else None, conf, synced, copied=copied)

    def draft_tree(self, context: Sequence[int], max_nodes: int, max_depth: int, params: SamplingParams,
                   rng: np.random.Generator, stop: Callable[[Sequence[float]], bool] | None = None) -> DraftTree:
        """A chain of up to max_depth tokens and, beside them, the alternatives its own forwards rank
        next, up to max_nodes in all (drafters.tree_draft.side_tree)."""
        self._dists = []
        try:
            chain = self.draft(context, min(max_depth, max_nodes), params, rng, stop)
            dists = self._dists[: len(chain.tokens)] if chain.q is None else list(chain.q)  # sampled: q itself
        finally:
            self._dists = None
        tree = side_tree(chain.tokens, dists, max_nodes, chain.q, rng, chain.confidence)
        tree.chain_draft = chain
        return tree

    def _handed(self, missed: int, n_context: int) -> bool:
        """Take the target's cells (it holds exactly the context but its last token) when copying
        all n_context of them costs less than evaluating the `missed` ones."""
        h = self.handoff
        if h is None or h.target.n_past != n_context or missed * h.read_ms <= n_context * h.ms_per_token:
            return False
        if not h.copy():
            self.handoff = None  # llama.cpp refused the cells (a smaller context): read from now on
            return False
        return True

    def cost_prior(self, note: Callable[[str], None] | None = None) -> DraftCost:
        """The scheduler's prior: a draft model pays about its own T(1) per drafted token, and once
        per cycle T(2) − T(1) more, for reading the previous cycle's last draft with the bonus token
        in its first step; and what it pays per token to read a prompt or tokens it skipped (timed
        once per model and cached with its cost profile)."""
        from edgespec import calibration

        # a few steps after a short context (~0.25 s for SmolLM2 Q4_1 here): a first generation
        # must not pay seconds for a prior the cycles' own timings refine at once
        t = calibration.calibrate(self.model, ks=(1, 2), note=note, context=DRAFT_CONTEXT, repeats=DRAFT_REPEATS)
        copy = None
        if self.handoff is not None:  # what it missed is copied instead where that is cheaper;
            read = self.handoff.read_ms  # its read cost was timed when the handoff opened
            copy = self.handoff.ms_per_token
        else:
            read = calibration.read_cost(self.model, note=note)
        self.reset()  # timing used the draft model's KV cache
        return DraftCost(max(0.0, t[2] - t[1]), t[1], catch_up_ms=read, copy_ms=copy)

    def reset(self) -> None:
        """Forget the cached context (after something else used the model's KV cache)."""
        self._kv = []
        self.model.truncate(0)

    def close(self) -> None:
        self.model.close()


def _fit(q: np.ndarray, n: int) -> np.ndarray:
    """Resize a drafter distribution to the target's vocabulary (sizes may differ by ≤ 128 ids)."""
    if q.shape[0] == n:
        return q
    if q.shape[0] > n:
        q = q[:n]
        s = q.sum()
        return q / s if s > 0 else np.full(n, 1.0 / n)
    return np.pad(q, (0, n - q.shape[0]))


def open_kv_handoff(target: Backend, model: Backend) -> KvHandoff | None:
    """The KV handoff from `target` to its draft model `model` (backends.llama_kv; None: none), as the
    pair's record in the profiles directory says. A pair never seen is trusted on its shapes and only
    its costs are timed (~0.1 s); one whose drafts were right less often than HANDOFF_DOUBT is probed
    (~1 s) once, and the verdict kept; the costs measured are kept too, so a later open times nothing."""
    from edgespec import calibration as cal
    from edgespec.backends.llama_kv import open_handoff

    path = cal.handoff_path(target, model)
    rec = cal.load_handoff(path)
    if rec is not None and not rec["use"]:
        return None
    accepted = cal.pair_acceptance(target, [model.path])
    doubt = accepted is not None and accepted < cal.HANDOFF_DOUBT
    if rec is not None and (rec["probed"] or not doubt):
        return open_handoff(target, model, costs=(rec["copy_ms"], rec["read_ms"]))
    h = open_handoff(target, model, probe=doubt)
    if h is not None or doubt:
        cal.save_handoff(path, h is not None, doubt, *((h.ms_per_token, h.read_ms) if h else (0.0, 0.0)))
    return h
