"""Batched self-distillation (train/generate.py) and pre-generated sequences in the feature cache
with its manifest (train/features.py), on the tiny target (and SmolLM2 where marked real)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgespec.backends.llama_cpp import LlamaCppBackend
from edgespec.errors import ContextOverflowError
from edgespec.train.features import MANIFEST, CachePlan, FeatureCache, Generated, build_cache, chat_tokens
from edgespec.train.generate import BatchGenerator, chat_prompts, corpus_prompts, sampling_mix, self_distill
from edgespec.train.prompt_gen import generate_prompts


def _prompts(n: int) -> list[tuple[str, ...]]:
    return [p.turns for p in generate_prompts(n, seed=3)]


def _tokens(gen, prompts):
    return [chat_tokens(gen, p) for p in prompts]


def _sequential_greedy(path, prompts, max_new, max_len=None):
    """The reference: one sequence at a time on a plain one-sequence backend (build_cache's old loop)."""
    out = []
    with LlamaCppBackend(path, n_ctx=1024, threads=1) as be:
        for p in prompts:
            tokens = chat_tokens(be, p)
            be.truncate(0)
            row, reply = be.eval(tokens)[-1], []
            while len(reply) < max_new and (max_len is None or len(tokens) + len(reply) < max_len):
                nxt = int(np.argmax(row))
                if be.is_eog(nxt):
                    break
                reply.append(nxt)
                row = be.eval([nxt])[-1]
            out.append(reply)
    return out


def test_batched_greedy_replies_equal_one_sequence_at_a_time(tiny_target):
    """16 prompts through 8 slots (every slot refilled at least once), caps that end sequences at
    different steps: token for token the one-sequence replies (llama.cpp's CPU kernels are batch
    invariant for this target; measured equal on SmolLM2 Q4_1 too, see the real test)."""
    prompts = _prompts(16)
    want = _sequential_greedy(tiny_target, prompts, max_new=24, max_len=72)
    with BatchGenerator(tiny_target, n_seq=8, seq_ctx=256, threads=1) as gen:
        got = self_distill(gen, _tokens(gen, prompts), ["gen"] * 16, max_new=24, max_len=72, greedy_share=1.0)
    assert [g.reply for g in got] == want
    assert len({len(r) for r in want}) > 1  # the length cap ended some sequences early
    assert all(g.temperature == 0.0 for g in got)


def test_replies_that_end_at_their_first_token_free_their_slot(tiny_target):
    """max_new = 1: every reply ends at its first token, so each slot takes its next prompt at once
    (the case a base model's immediate end-of-text hits): the next prompt starts from an empty
    sequence, not after the last one's KV (llama.cpp refused that decode: positions not consecutive)."""
    prompts = _prompts(12)
    want = [r[:1] for r in _sequential_greedy(tiny_target, prompts, max_new=1)]
    with BatchGenerator(tiny_target, n_seq=4, seq_ctx=256, threads=1) as gen:
        got = self_distill(gen, _tokens(gen, prompts), ["gen"] * 12, max_new=1, greedy_share=1.0)
    assert [g.reply for g in got] == want and all(len(r) == 1 for r in want)


def test_sampled_replies_do_not_depend_on_slot_or_batch(tiny_target, tmp_path):
    prompts = _prompts(10)
    runs = []
    for n_seq in (8, 3):
        with BatchGenerator(tiny_target, n_seq=n_seq, seq_ctx=256, threads=1) as gen:
            runs.append(self_distill(gen, _tokens(gen, prompts), [f"s{i}" for i in range(10)], max_new=16, seed=5))
    assert runs[0] == runs[1]
    temps = [g.temperature for g in runs[0]]
    assert temps == sampling_mix(10, seed=5) and 0 < temps.count(0.0) < 10
    greedy = _sequential_greedy(tiny_target, prompts, max_new=16)
    for g, ref in zip(runs[0], greedy):
        assert (g.reply == ref) == (g.temperature == 0.0)  # a sampled reply of a random model leaves the argmax
        assert g.source.startswith("s")


def test_sampling_mix_is_seeded_and_in_range():
    mix = sampling_mix(2000, seed=0)
    assert mix == sampling_mix(2000, seed=0) and mix != sampling_mix(2000, seed=1)
    sampled = [t for t in mix if t]
    assert 0.45 < 1 - len(sampled) / 2000 < 0.55
    assert min(sampled) >= 0.7 and max(sampled) <= 1.0
    assert sampling_mix(10, greedy_share=1.0) == [0.0] * 10
    assert sampling_mix(700, seed=0) == mix[:700]  # prefix-stable: more prompts keep the first ones' mix
    with pytest.raises(ValueError, match="1.5"):
        sampling_mix(3, greedy_share=1.5)


def test_self_distill_resumes_from_its_file(tiny_target, tmp_path):
    prompts, out = _prompts(9), tmp_path / "gen.jsonl"
    with BatchGenerator(tiny_target, n_seq=4, seq_ctx=256, threads=1) as gen:
        whole = self_distill(gen, _tokens(gen, prompts), ["x"] * 9, max_new=12, seed=2, out=out)
        lines = out.read_text().splitlines()
        assert len(lines) == 9 and sorted(json.loads(x)["index"] for x in lines) == list(range(9))
        out.write_text("\n".join(lines[:4]) + "\n" + lines[4][:10])  # interrupted mid-line
        again = self_distill(gen, _tokens(gen, prompts), ["x"] * 9, max_new=12, seed=2, out=out)
    assert again == whole
    done = [json.loads(x)["index"] for x in out.read_text().splitlines()[5:]]
    assert sorted(done) == sorted(json.loads(x)["index"] for x in lines[4:])  # only the missing ones were generated


def test_a_prompt_beyond_the_sequence_context_is_refused(tiny_target):
    with BatchGenerator(tiny_target, n_seq=2, seq_ctx=256, threads=1) as gen:
        with pytest.raises(ContextOverflowError, match="prompt 1"):
            list(gen.replies([[1, 2, 3], list(range(5, 300))], [0.0, 0.0], max_new=8))
    with pytest.raises(ValueError, match="300"):
        BatchGenerator(tiny_target, n_seq=2, seq_ctx=300)


def _five_replies(tiny_target, max_new: int) -> tuple[list[Generated], CachePlan]:
    """Self-distilled replies to 5 prompts (sources gen:0..4) and a cache plan for them."""
    with BatchGenerator(tiny_target, n_seq=4, seq_ctx=256, threads=1) as gen:
        seqs = self_distill(gen, _tokens(gen, _prompts(5)), [f"gen:{i}" for i in range(5)], max_new=max_new, seed=1)
    return seqs, CachePlan(target=str(tiny_target), target_size=1, seq_len=64, corpus_chars=0)


def test_cache_of_generated_sequences_with_manifest_and_resume(tiny_target, tmp_path):
    from edgespec.backends.llama_features import LlamaFeatureBackend

    seqs, plan = _five_replies(tiny_target, max_new=20)
    text = ["The quick brown fox jumps over the lazy dog near the quiet river bank. " * 12]
    with LlamaFeatureBackend(tiny_target, layers=(1, 1, 1), n_ctx=256, threads=1) as be:
        cache = build_cache(be, tmp_path / "c", plan, text, generated=seqs)
        files = cache.files()
        assert len(files) > 5
        for g, f in zip(seqs, files[-5:]):  # after the corpus windows
            z = FeatureCache.load_file(f)
            np.testing.assert_array_equal(z["tokens"], g.prompt + g.reply)
            assert int(z["n_prompt"]) == len(g.prompt) and str(z["source"]) == g.source
            assert float(z["temperature"]) == pytest.approx(g.temperature)
            reply_rows = z["top_ids"][len(g.prompt) - 1:-1, 0]
            if g.temperature == 0.0:  # a greedy reply is the argmax of its own feature-pass labels
                np.testing.assert_array_equal(reply_rows, g.reply)
        manifest = cache.manifest()
        assert [m["file"] for m in manifest] == [f.name for f in files]
        assert [m["source"] for m in manifest] == ["corpus"] * (len(files) - 5) + [g.source for g in seqs]
        assert [m["temperature"] for m in manifest][-5:] == pytest.approx([g.temperature for g in seqs])
        assert sum(m["tokens"] for m in manifest) == sum(len(FeatureCache.load_file(f)["tokens"]) for f in files)
        mtimes = [f.stat().st_mtime_ns for f in files]
        (tmp_path / "c" / MANIFEST).unlink()
        files[-1].unlink()
        build_cache(be, tmp_path / "c", plan, text, generated=seqs)  # resume: only the missing file
        assert [f.stat().st_mtime_ns for f in files[:-1]] == mtimes[:-1] and files[-1].exists()
        assert FeatureCache(tmp_path / "c").manifest() == manifest  # rebuilt from the files
        with pytest.raises(ValueError, match="n_generated"):
            build_cache(be, tmp_path / "c", plan, text, generated=seqs[:3])
        with pytest.raises(ValueError, match="differs in generated_prompts\\)"):  # same count, another mix
            build_cache(be, tmp_path / "c", plan, text, generated=[g._replace(temperature=0.5) for g in seqs])


def test_a_generated_cache_grows_with_more_prompts(tiny_target, tmp_path):
    """More --gen-prompts: the cache of the first 3 replies keeps its files and evaluates only the 2
    new ones (generated sequences come last, so no index moves); a changed prefix is still refused."""
    from edgespec.backends.llama_features import LlamaFeatureBackend

    seqs, plan = _five_replies(tiny_target, max_new=12)
    text = ["A line of plain corpus text about rivers and hills. " * 12]
    with LlamaFeatureBackend(tiny_target, layers=(1, 1, 1), n_ctx=256, threads=1) as be:
        small = build_cache(be, tmp_path / "c", plan, text, generated=seqs[:3]).files()
        mtimes = [f.stat().st_mtime_ns for f in small]
        with pytest.raises(ValueError, match="n_generated"):  # another first reply: not a prefix
            build_cache(be, tmp_path / "c", plan, text, generated=[seqs[0]._replace(source="x"), *seqs[1:]])
        grown = build_cache(be, tmp_path / "c", plan, text, generated=seqs)
        files = grown.files()
        assert files[:len(small)] == small and len(files) == len(small) + 2
        assert [f.stat().st_mtime_ns for f in small] == mtimes  # not evaluated again
        assert [m["source"] for m in grown.manifest()][-5:] == [g.source for g in seqs]
        build_cache(be, tmp_path / "c", plan, text, generated=seqs)  # the grown plan is the cache's now
        with pytest.raises(ValueError, match="n_generated"):
            build_cache(be, tmp_path / "c", plan, text, generated=seqs[:4])


def test_prompt_sources_render_chats_and_corpus_windows(tiny_target):
    prompts = generate_prompts(14, seed=0)
    text = "A line of plain corpus text about rivers and hills. " * 60
    with BatchGenerator(tiny_target, n_seq=2, seq_ctx=256, threads=1) as gen:
        tokens, sources = chat_prompts(gen, prompts)
        assert tokens == _tokens(gen, [p.turns for p in prompts])
        assert sources == [f"gen:{p.category}" for p in prompts]
        windows, kinds = corpus_prompts(gen, [text], prefix=16, seq_len=100)
        whole, bos = gen.tokenize(text), [gen.bos_id] if gen.add_bos else []
    assert len(windows) == (len(whole) - 16) // 100 + 1 and set(kinds) == {"gen:corpus"}
    assert windows[0] == whole[:16] and all(len(w) == 16 for w in windows)
    assert windows[1] == bos + whole[100:116 - len(bos)]  # a later window starts as a text does


def test_generated_record_order():
    g = Generated([1, 2], [3], 0.8, "gen:chat")
    assert (g.prompt, g.reply, g.temperature, g.source) == ([1, 2], [3], 0.8, "gen:chat")


@pytest.mark.real
def test_batched_greedy_equals_sequential_on_smollm2(smollm2_path):
    prompts = _prompts(10)
    want = _sequential_greedy(smollm2_path, prompts, max_new=32)
    with BatchGenerator(smollm2_path, n_seq=8, seq_ctx=512, threads=2) as gen:
        got = self_distill(gen, _tokens(gen, prompts), ["gen"] * 10, max_new=32, greedy_share=1.0)
    assert [g.reply for g in got] == want
