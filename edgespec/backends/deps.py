"""The one place the optional heavy libraries (llama-cpp-python, mlx) are imported.

Each import fails with a one-line MissingDependencyError naming the extra to install, so
``edgespec --help`` and the numpy paths work with neither installed.

llama.cpp's log is process-global (one C callback): every line goes to a ring buffer (quoted in
load errors) and is echoed to stderr while at least one object that asked for it
(``show_llama_log``: a backend opened with verbose=True) is alive and not closed. A quiet backend
opened later therefore never silences a verbose one.
"""

from __future__ import annotations

import collections
import ctypes
import os
import weakref
from typing import Any

from edgespec.errors import MissingDependencyError

_LOG: collections.deque[str] = collections.deque(maxlen=200)  # llama.cpp's last log lines
_SHOWING: weakref.WeakSet[Any] = weakref.WeakSet()  # the verbose owners alive: echo while non-empty
_CALLBACK: list[Any] = []  # the installed C callback: C holds only its pointer, this keeps it alive


def import_llama() -> Any:
    """The llama_cpp module, its log routed to the ring buffer and llama_backend_init called (once).

    Raises:
        MissingDependencyError: llama-cpp-python is not installed.
    """
    try:
        import llama_cpp
    except ImportError as e:  # the optional extra is missing
        raise MissingDependencyError(
            "the llama.cpp backend needs llama-cpp-python: pip install 'edgespec[llama]'") from e
    if not _CALLBACK:
        @llama_cpp.llama_log_callback
        def _log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            _LOG.append(text.decode("utf-8", "replace"))
            if _SHOWING:
                os.write(2, text)

        _CALLBACK.append(_log)
        llama_cpp.llama_log_set(_log, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
    return llama_cpp


def import_mlx() -> Any:
    """mlx.core (mlx-lm checked too).

    Raises:
        MissingDependencyError: mlx or mlx-lm is not installed.
    """
    try:
        import mlx.core as mx
        import mlx_lm  # noqa: F401
    except ImportError as e:
        raise MissingDependencyError(
            f"the MLX backend needs mlx and mlx-lm ({e.name} is missing): pip install 'edgespec[mlx]'") from e
    return mx


def show_llama_log(owner: object) -> None:
    """Echo llama.cpp's log to stderr while `owner` lives (until ``hide_llama_log(owner)``)."""
    _SHOWING.add(owner)


def hide_llama_log(owner: object) -> None:
    """Stop echoing on `owner`'s behalf (other verbose owners still see the log)."""
    _SHOWING.discard(owner)


def llama_log_shown() -> bool:
    """Whether llama.cpp's log is echoed to stderr now."""
    return bool(_SHOWING)


def llama_log() -> list[str]:
    """llama.cpp's last log lines (at most 200), oldest first."""
    return list(_LOG)


def clear_llama_log() -> None:
    """Forget the logged lines (before a load, so its error is the one quoted)."""
    _LOG.clear()
