"""backends/deps.py: the optional imports fail in one line, and llama.cpp's process-global log is
echoed while any verbose owner is open (a quiet backend opened later never silences it)."""

from __future__ import annotations

import gc
import sys

import pytest

from edgespec.backends import deps
from edgespec.errors import MissingDependencyError


class Owner:
    """Stands for a backend: anything that can be weakly referenced."""


def test_a_quiet_owner_does_not_silence_a_verbose_one() -> None:
    loud, quiet = Owner(), Owner()
    deps.show_llama_log(loud)
    deps.hide_llama_log(quiet)  # what a verbose=False backend's close does
    assert deps.llama_log_shown()
    deps.hide_llama_log(loud)
    assert not deps.llama_log_shown()


def test_echo_lasts_while_any_verbose_owner_lives() -> None:
    a, b = Owner(), Owner()
    deps.show_llama_log(a)
    deps.show_llama_log(b)
    deps.hide_llama_log(a)
    assert deps.llama_log_shown()
    del b  # garbage collected without close(): its request goes with it
    gc.collect()
    assert not deps.llama_log_shown()
    del a


def test_missing_llama_cpp_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now raises ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install 'edgespec\[llama\]'") as err:
        deps.import_llama()
    assert "\n" not in str(err.value)


@pytest.mark.real
def test_backends_share_the_log_honestly(tiny_target) -> None:
    from edgespec.backends.llama_cpp import LlamaCppBackend, LlamaVocab

    with LlamaCppBackend(tiny_target, n_ctx=64, threads=1, verbose=True) as loud:
        assert deps.llama_log_shown()
        with LlamaCppBackend(tiny_target, n_ctx=64, threads=1) as quiet:
            assert deps.llama_log_shown() and quiet.llama_context and loud.llama_context
        LlamaVocab(tiny_target).close()
        assert deps.llama_log_shown()
        assert deps.llama_log()  # the load's lines are kept either way
    assert not deps.llama_log_shown()
    assert loud.llama_context is None and loud.llama_model is None  # closed: handles freed once
    loud.close()  # a second close is a no-op
