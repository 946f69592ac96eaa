"""Feature heads (EAGLE-3) and their GGUF files."""

from __future__ import annotations

from edgespec.heads.eagle3 import Eagle3Config, Eagle3Head, random_tensors
from edgespec.heads.gguf_io import read_eagle3_gguf, write_eagle3_gguf

__all__ = ["Eagle3Config", "Eagle3Head", "random_tensors", "read_eagle3_gguf", "write_eagle3_gguf"]
