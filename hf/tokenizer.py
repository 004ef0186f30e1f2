"""An imported model's tokenizer: its directory's ``tokenizer.json`` through
``triax.text.hf_tokenizer`` with the tokenizer's own template (as ``transformers``'
``tokenizer(text)`` encodes prompts), checked against the model's vocabulary.

    >>> import os, tempfile
    >>> from tokenizers import Tokenizer, models, pre_tokenizers
    >>> t = Tokenizer(models.WordLevel({"hi": 0, "mesh": 1, "[UNK]": 2}, unk_token="[UNK]"))
    >>> t.pre_tokenizer = pre_tokenizers.Whitespace()
    >>> d = tempfile.mkdtemp()
    >>> t.save(os.path.join(d, "tokenizer.json"))
    >>> tok = load_tokenizer(d)
    >>> tok.encode("hi mesh").tolist(), tok.vocab_size
    ([0, 1], 3)
"""
from __future__ import annotations

from triax.hf.files import HFError
from triax.models.config import ModelConfig
from triax.text.hf_tokenizer import FILE, HFTokenizer, load_tokenizer as _load

__all__ = ["FILE", "HFTokenizer", "check_vocab", "load_tokenizer"]


def check_vocab(vocab_size: int, cfg: ModelConfig, where: str) -> None:
    """A tokenizer may not produce ids the model has no embedding row for."""
    if vocab_size > cfg.vocab_size:
        raise HFError(f"tokenizer {where} has {vocab_size} tokens but the model's vocab_size "
                      f"is {cfg.vocab_size}; use the tokenizer the model was trained with")


def load_tokenizer(path: str, cfg: ModelConfig | None = None) -> HFTokenizer:
    """The tokenizer at ``path`` (directory or file), checked against ``cfg`` when given."""
    tok = _load(path, template=True)
    if cfg is not None:
        check_vocab(tok.vocab_size, cfg, tok.source)
    return tok
