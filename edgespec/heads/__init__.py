"""Feature heads (EAGLE-3, DFlash) and their GGUF files."""

from __future__ import annotations

from edgespec.heads.dflash import DFlashConfig, DFlashHead
from edgespec.heads.dflash_gguf import read_dflash_gguf, write_dflash_gguf
from edgespec.heads.eagle3 import Eagle3Config, Eagle3Head, random_tensors
from edgespec.heads.gguf_io import read_eagle3_gguf, write_eagle3_gguf

__all__ = ["DFlashConfig", "DFlashHead", "Eagle3Config", "Eagle3Head", "random_tensors", "read_dflash_gguf",
           "read_eagle3_gguf", "write_dflash_gguf", "write_eagle3_gguf"]
