"""Exceptions edgespec raises. Every message is one line that names the bad input."""

from __future__ import annotations


class EdgespecError(Exception):
    """Base class for errors a user can act on (bad file, bad parameter, overflow)."""


class ModelLoadError(EdgespecError):
    """A model file is missing, not GGUF, truncated, or rejected by the backend."""


class VocabMismatchError(EdgespecError):
    """A drafter's vocabulary is not the target's."""


class ContextOverflowError(EdgespecError):
    """The prompt (plus what must be generated) does not fit the context window."""


class BackendError(EdgespecError):
    """A backend call failed (a C return code turned into an exception)."""


class MissingDependencyError(EdgespecError):
    """An optional extra (llama-cpp-python, mlx, torch, matplotlib) is not installed."""


class DeviceError(EdgespecError):
    """A torch device that was asked for is unknown or absent on this machine."""


class EngineBusyError(EdgespecError):
    """The engine is already generating (one generation at a time; a server answers 503)."""
