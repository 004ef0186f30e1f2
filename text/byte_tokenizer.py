"""Byte-level tokenizer: ids 0..255 are raw bytes, then a few specials.

The byte presets use ``vocab_size = BYTE_VOCAB`` (256 bytes + 8 ids reserved for specials), so
any UTF-8 text round-trips exactly and no vocabulary file is needed.

    >>> tok = ByteTokenizer()
    >>> tok.decode(tok.encode("héllo"))
    'héllo'
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NUM_BYTES = 256
NUM_SPECIALS = 8  # BOS, EOS, PAD and reserved ids, padded so the vocabulary is a multiple of 8
BYTE_VOCAB = NUM_BYTES + NUM_SPECIALS  # the one home of the byte vocabulary size


@dataclass(frozen=True)
class ByteTokenizer:
    bos_id: int = NUM_BYTES
    eos_id: int = NUM_BYTES + 1
    pad_id: int = NUM_BYTES + 2
    vocab_size: int = BYTE_VOCAB

    def encode(self, text: str | bytes, bos: bool = False, eos: bool = False) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        ids = np.frombuffer(data, dtype=np.uint8).astype(np.int32)
        parts = ([np.array([self.bos_id], np.int32)] if bos else []) + [ids] + (
            [np.array([self.eos_id], np.int32)] if eos else [])
        return np.concatenate(parts) if len(parts) > 1 else ids

    def decode(self, ids) -> str:
        arr = np.asarray(ids).reshape(-1)
        return bytes(int(i) for i in arr if 0 <= int(i) < NUM_BYTES).decode("utf-8", "replace")
