"""The one tokenizer interface training, data and generation share, and how ``--tokenizer``
picks one.

Two implementations: ``ByteTokenizer`` (the default; no files, the byte presets' vocabulary)
and ``HFTokenizer`` (a Hugging Face ``tokenizer.json``, ``triax.text.hf_tokenizer``).

    >>> tok = get_tokenizer(None)
    >>> type(tok).__name__, tok.vocab_size
    ('ByteTokenizer', 264)
    >>> tok.decode(tok.encode("hi", bos=True, eos=True))
    'hi'
"""
from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import numpy as np

from triax.text.byte_tokenizer import ByteTokenizer
from triax.text.hf_tokenizer import load_tokenizer


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> int32 ids. ``bos_id``/``eos_id``/``pad_id`` may be None where the vocabulary
    has no such token (then ``encode`` cannot add it)."""

    vocab_size: int
    bos_id: Optional[int]
    eos_id: Optional[int]
    pad_id: Optional[int]

    def encode(self, text: str | bytes, bos: bool = False, eos: bool = False) -> np.ndarray: ...

    def decode(self, ids) -> str: ...


def get_tokenizer(path: Optional[str]) -> Tokenizer:
    """``--tokenizer``: None or "" is the byte tokenizer; otherwise a directory holding
    ``tokenizer.json`` or the file itself (``load_tokenizer``)."""
    return ByteTokenizer() if not path else load_tokenizer(path)
