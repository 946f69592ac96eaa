"""The tokenizer of an mlx-lm model directory (tokenizer.json, read locally by `transformers`), with the
vocabulary calls the Backend protocol needs. Used by the MLX backend for directories that were not
converted from GGUF (those carry tokenizer.gguf and use llama.cpp's tokenizer instead)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from edgespec.backends.base import VocabInfo
from edgespec.errors import ModelLoadError

_EOG_TEXTS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end|>")
_BPE, _SPM = 2, 1  # llama_vocab_type values, for the draft/target compatibility rule


class HfVocab:
    def __init__(self, model_dir: Path) -> None:
        try:
            from transformers import AutoTokenizer

            self._tok = tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read the tokenizer of {model_dir}: {e}") from e
        backend = json.loads(tok.backend_tokenizer.to_str()) if getattr(tok, "is_fast", False) else {}
        self._byte_level = "ByteLevel" in json.dumps(backend.get("decoder"))
        if self._byte_level:
            from mlx_lm.tokenizer_utils import _byte_decoder

            self._bytes_of = _byte_decoder()
        self.n_vocab = len(tok)
        self.bos_id, self.eos_id = tok.bos_token_id, tok.eos_token_id
        probe = tok.encode("a", add_special_tokens=True)
        self.add_bos = self.bos_id is not None and probe[:1] == [self.bos_id]
        self._add_eos = self.eos_id is not None and probe[-1:] == [self.eos_id]
        self._special = set(tok.all_special_ids)
        vocab = tok.get_vocab()
        self._eog = {self.eos_id, *(vocab[t] for t in _EOG_TEXTS if t in vocab)} - {None}
        self.token_to_bytes = lru_cache(maxsize=None)(self._piece)
        self._config = json.loads((model_dir / "config.json").read_text())

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return list(self._tok(text, add_special_tokens=add_special, split_special_tokens=not parse_special)
                    ["input_ids"])

    def _piece(self, token: int) -> bytes:
        if token in self._special:
            return b""
        piece = self._tok.convert_ids_to_tokens(token)
        if self._byte_level and all(c in self._bytes_of for c in piece):
            return bytes(self._bytes_of[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte token
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    def vocab_fingerprint(self) -> VocabInfo:
        return VocabInfo(_BPE if self._byte_level else _SPM, self.n_vocab, self.add_bos, self.bos_id,
                         self._add_eos, self.eos_id, lambda i: self._tok.convert_ids_to_tokens(i) or "")

    def metadata(self, key: str) -> str | None:
        if key == "tokenizer.chat_template":
            return getattr(self._tok, "chat_template", None)
        if key == "general.architecture":
            return self._config.get("model_type")
        return None

    def close(self) -> None:
        pass
