"""Minimal byte-level text codec matching the presets' 264-token vocabulary.

Ids 0..255 are raw UTF-8 bytes; 256 is BOS and 257 EOS (the ids of
``triax.training.tokenizer.ByteTokenizer``). Kept here so inference does not depend on the
training package; the two are meant to be unified.

    >>> decode(encode("héllo"))
    'héllo'
"""
from __future__ import annotations

import numpy as np

BOS_ID, EOS_ID = 256, 257


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


def decode(ids) -> str:
    """Bytes back to text; special ids are dropped, broken UTF-8 shows as U+FFFD."""
    return bytes(int(i) for i in np.asarray(ids).reshape(-1) if 0 <= int(i) < 256).decode(
        "utf-8", "replace")
