"""Clear one-line errors on real files and models, and nothing lost: an engine that raised stays usable.

Every error is an edgespec exception whose message is ONE line naming the bad input. Where an engine
was already loaded, the same greedy generation before and after the error gives the same tokens, the
target's KV cache still holds exactly what the engine's bookkeeping says, and the cached prompt prefix
survived (the repeat evaluates only the last prompt token).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf_fixtures import truncate_file, write_not_gguf
from typer.testing import CliRunner

import edgespec
from edgespec.cli.app import app
from edgespec.errors import ContextOverflowError, ModelLoadError, VocabMismatchError
from edgespec.sampling import InvalidSamplingError

pytestmark = pytest.mark.real

PROMPT = "The history of the printing press begins"
# A truncated file must be diagnosed without parsing the whole vocabulary (gguf.GGUFReader: 3-15 s).


def one_line(err: BaseException) -> str:
    text = str(err)
    assert text.strip(), f"{type(err).__name__} has an empty message"
    assert "\n" not in text and "\r" not in text, f"not one line: {text!r}"
    return text


@pytest.fixture(scope="module")
def engine(smollm2_path):
    """SmolLM2 + n-gram drafter in a small context (threads=1: the machine is shared)."""
    with edgespec.load(smollm2_path, drafter="ngram", n_ctx=256, threads=1) as eng:
        yield eng


def check_still_usable(engine, before) -> None:
    """The greedy generation `before` (of PROMPT) repeats exactly, reusing the cached prompt."""
    after = engine.generate(PROMPT, max_tokens=len(before.tokens))
    assert after.tokens == before.tokens
    assert after.stats.n_prompt_evaluated == 1  # the cached prefix survived the error
    # a first auto reply leaves an idle timing run that empties the target's cache and rebuilds it:
    # the cache is the engine's again once that run is over
    engine.wait_priced()
    assert engine.target.n_past == len(engine._kv)
    ids = engine.target.tokenize(PROMPT)
    assert engine._kv[: len(ids)] == ids


# -- files ------------------------------------------------------------------------------------------


def test_missing_file():
    with pytest.raises(ModelLoadError) as info:
        edgespec.load("/nonexistent/x.gguf")
    msg = one_line(info.value)
    assert "/nonexistent/x.gguf" in msg and "not found" in msg


def test_missing_drafter_file(smollm2_path):
    with pytest.raises(ModelLoadError) as info:
        edgespec.load(smollm2_path, drafter="/nonexistent/drafter.gguf", n_ctx=256, threads=1)
    assert "/nonexistent/drafter.gguf" in one_line(info.value)


def test_not_gguf(tmp_path):
    path = write_not_gguf(tmp_path / "weights.gguf")
    with pytest.raises(ModelLoadError) as info:
        edgespec.load(path, drafter=None)
    msg = one_line(info.value)
    assert str(path) in msg and "not a GGUF file" in msg


def _truncation_error(path) -> str:
    """The one-line error of loading a cut file; it names the file and says it is truncated."""
    with pytest.raises(ModelLoadError) as info:
        edgespec.load(path, drafter=None, n_ctx=256)
    msg = one_line(info.value)
    assert str(path) in msg and "truncated" in msg
    return msg


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_tiny_gguf(tmp_path, tiny_target, keep):
    path = truncate_file(tiny_target, tmp_path / "cut.gguf", keep)
    msg = _truncation_error(path)
    assert "tensor " in msg  # names the first tensor that lies past the end
    assert str(path.stat().st_size) in msg


@pytest.mark.parametrize("keep", [0.5, 0.005, 0.0000001])
def test_truncated_real_size_gguf(tmp_path, smollm2_path, keep):
    """SmolLM2 (49k-token vocabulary, 98 MB) cut in its tensor data, in its metadata, in its header."""
    path = truncate_file(smollm2_path, tmp_path / "cut.gguf", keep)
    msg = _truncation_error(path)
    if keep == 0.5:
        assert "tensor blk." in msg and "98362432" in msg  # what the full file needs
    else:
        assert "header" in msg


def test_truncated_drafter(tmp_path, smollm2_path, tiny_drafter):
    path = truncate_file(tiny_drafter, tmp_path / "cut_drafter.gguf", 0.5)
    with pytest.raises(ModelLoadError) as info:
        edgespec.load(smollm2_path, drafter=path, n_ctx=256, threads=1)
    msg = one_line(info.value)
    assert str(path) in msg and "truncated" in msg


# -- vocabularies -----------------------------------------------------------------------------------


def test_vocab_mismatch_names_both_files_and_first_token(smollm2_path, gemma_q4_path):
    with pytest.raises(VocabMismatchError) as info:
        edgespec.load(gemma_q4_path, drafter=smollm2_path, n_ctx=256, threads=1)
    msg = one_line(info.value)
    assert str(smollm2_path) in msg and str(gemma_q4_path) in msg
    assert "first differing token" in msg
    assert msg.index(str(smollm2_path)) < msg.index(str(gemma_q4_path))  # "drafter X ... target Y"


def test_a_compatible_pair_is_compared_once_a_mismatch_every_time(smollm2_path, gemma_q4_path, tiny_target,
                                                                 tiny_drafter, monkeypatch, tmp_path):
    from edgespec.backends.llama_cpp import LlamaCppBackend
    from edgespec.drafters import draft_model

    monkeypatch.setenv("EDGESPEC_HOME", str(tmp_path))
    compared = []
    real = draft_model._compare_vocabs
    monkeypatch.setattr(draft_model, "_compare_vocabs", lambda t, d: compared.append(1) or real(t, d))
    with LlamaCppBackend(tiny_target, n_ctx=64, threads=1) as t, LlamaCppBackend(tiny_drafter, n_ctx=64, threads=1) as d:
        draft_model.check_vocab_compatible(t, d)
        draft_model.check_vocab_compatible(t, d)
    assert len(compared) == 1  # kept per pair of files in $EDGESPEC_HOME/profiles
    with LlamaCppBackend(gemma_q4_path, n_ctx=64, threads=1) as t, LlamaCppBackend(smollm2_path, n_ctx=64, threads=1) as d:
        for _ in range(2):
            with pytest.raises(VocabMismatchError):
                draft_model.check_vocab_compatible(t, d)
    assert len(compared) == 3


def test_same_vocab_pair_loads_and_drafts(tiny_target, tiny_drafter):
    with edgespec.load(tiny_target, drafter=tiny_drafter, n_ctx=256, threads=1, num_draft=4) as eng:
        out = eng.generate(PROMPT, max_tokens=16)
        assert len(out.tokens) == 16
        assert out.stats.n_drafted > 0 and out.stats.n_accepted > 0
        assert eng.target.n_past == len(eng._kv)


# -- context and sampling ---------------------------------------------------------------------------


def test_prompt_longer_than_context(engine):
    before = engine.generate(PROMPT, max_tokens=12)
    long_prompt = " ".join(f"item{i}" for i in range(130))
    n = len(engine.target.tokenize(long_prompt))
    assert n > 300
    with pytest.raises(ContextOverflowError) as info:
        engine.generate(long_prompt, max_tokens=8)
    msg = one_line(info.value)
    assert str(n) in msg and "256" in msg
    check_still_usable(engine, before)


def test_prompt_at_the_context_edge_stops_with_length(engine):
    """A prompt that fits with a few positions left: generation stops at the context, no error."""
    before = engine.generate(PROMPT, max_tokens=12)
    ids = engine.target.tokenize(PROMPT)
    filler = engine.target.tokenize(" ".join(["word"] * 400), add_special=False)
    out = engine.generate((ids + filler)[:250], max_tokens=50)
    assert out.finish_reason == "length"
    assert 1 <= len(out.tokens) <= 256 - 250 + 1
    assert engine.target.n_past == len(engine._kv) <= 256
    check_still_usable(engine, before)  # PROMPT is a prefix of the full context: rolled back to it


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"temperature": -0.5}, "-0.5"),
    ({"temperature": 0.7, "top_p": 0.0}, "0.0"),
    ({"temperature": 0.7, "top_p": 1.5}, "1.5"),
])
def test_invalid_sampling(engine, kwargs, needle):
    before = engine.generate(PROMPT, max_tokens=12)
    with pytest.raises(InvalidSamplingError) as info:
        engine.generate(PROMPT, max_tokens=8, **kwargs)
    msg = one_line(info.value)
    name = "top_p" if "top_p" in kwargs else "temperature"
    assert name in msg and needle in msg
    check_still_usable(engine, before)


# -- the command line -------------------------------------------------------------------------------


def _cli(*args: str):
    return CliRunner().invoke(app, list(args))


def _error_line(result) -> str:
    assert result.exit_code == 1, (result.exit_code, result.output, result.exception)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def test_cli_missing_target():
    line = _error_line(_cli("generate", "--target", "/nonexistent.gguf", "-p", "hi"))
    assert "/nonexistent.gguf" in line and "not found" in line


def test_cli_truncated_target(tmp_path: Path, tiny_target):
    path = truncate_file(tiny_target, tmp_path / "cut.gguf", 0.5)
    line = _error_line(_cli("generate", "--target", str(path), "-p", "hi", "--ctx", "256"))
    assert str(path) in line and "truncated" in line


def test_cli_invalid_temperature_before_loading():
    line = _error_line(_cli("generate", "--target", "/nonexistent.gguf", "--temp", "-1", "-p", "hi"))
    assert "temperature" in line and "-1" in line
