"""Feature heads (EAGLE-3, DFlash, DSpark): configs, GGUF files, and their runners on libllama and MLX
(which head kind runs on which runtime: drafters.heads.HEAD_RUNTIMES, docs/heads.md)."""

from __future__ import annotations

from edgespec.heads.dflash import DFlashConfig
from edgespec.heads.dflash_gguf import read_dflash_gguf, write_dflash_gguf
from edgespec.heads.eagle3 import Eagle3Config, Eagle3Head, random_tensors
from edgespec.heads.gguf_io import read_eagle3_gguf, write_eagle3_gguf

__all__ = ["DFlashConfig", "Eagle3Config", "Eagle3Head", "random_tensors", "read_dflash_gguf",
           "read_eagle3_gguf", "write_dflash_gguf", "write_eagle3_gguf"]
