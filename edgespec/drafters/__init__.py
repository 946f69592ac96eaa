"""Drafters: one protocol (base.Drafter), one file per implementation."""

from __future__ import annotations

from edgespec.drafters.base import Draft, Drafter

__all__ = ["Draft", "Drafter"]
