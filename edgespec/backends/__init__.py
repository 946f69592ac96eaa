"""Backends: one protocol (base.Backend), one file per implementation, imported lazily."""

from __future__ import annotations

from edgespec.backends.base import Backend, LogitRows

__all__ = ["Backend", "LogitRows"]
