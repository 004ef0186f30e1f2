"""A model directory's ``tokenizer.json`` (Hugging Face ``tokenizers``), checked against the
model's vocabulary.

Prompts are encoded with the tokenizer's own template (a Llama 3 ``tokenizer.json`` adds
``<|begin_of_text|>`` itself), as ``transformers``' ``tokenizer(text)`` does by default.

    >>> from tokenizers import Tokenizer, models, pre_tokenizers
    >>> t = Tokenizer(models.WordLevel({"hi": 0, "mesh": 1, "[UNK]": 2}, unk_token="[UNK]"))
    >>> t.pre_tokenizer = pre_tokenizers.Whitespace()
    >>> t.save("tokenizer.json")
    >>> tok = load_tokenizer(".")
    >>> tok.encode("hi mesh").tolist(), tok.vocab_size
    ([0, 1], 3)
"""
from __future__ import annotations

import os

import numpy as np
from tokenizers import Tokenizer

from triax.hf.files import HFError
from triax.models.config import ModelConfig

FILE = "tokenizer.json"


class HFTokenizer:
    """``encode(text) -> ids``, ``decode(ids) -> text``, ``vocab_size``."""

    def __init__(self, path: str):
        file = os.path.join(path, FILE) if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise HFError(f"no {FILE} at {path!r}; give a model directory holding one, or "
                          f"the file itself")
        try:
            self.tok = Tokenizer.from_file(file)
        except Exception as e:  # the Rust side raises a bare Exception on bad JSON
            raise HFError(f"{file} is not a valid {FILE} ({str(e)[:200]})") from None
        self.file = file
        self.vocab_size = int(self.tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text).ids, np.int32)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in np.asarray(ids).reshape(-1)],
                               skip_special_tokens=True)


def check_vocab(vocab_size: int, cfg: ModelConfig, where: str) -> None:
    """A tokenizer may not produce ids the model has no embedding row for."""
    if vocab_size > cfg.vocab_size:
        raise HFError(f"tokenizer {where} has {vocab_size} tokens but the model's vocab_size "
                      f"is {cfg.vocab_size}; use the tokenizer the model was trained with")


def load_tokenizer(path: str, cfg: ModelConfig | None = None) -> HFTokenizer:
    """The tokenizer at ``path`` (directory or file), checked against ``cfg`` when given."""
    tok = HFTokenizer(path)
    if cfg is not None:
        check_vocab(tok.vocab_size, cfg, tok.file)
    return tok
