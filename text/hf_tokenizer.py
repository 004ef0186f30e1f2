"""A Hugging Face ``tokenizer.json`` behind triax's tokenizer interface (``triax.text.tokenizer``).

``load_tokenizer(path)`` takes a model directory (it reads ``tokenizer.json`` and, when there,
``tokenizer_config.json`` for the BOS/EOS/PAD tokens) or the ``tokenizer.json`` file itself.
Special tokens are added by ``encode(bos=, eos=)``, never by the tokenizer's own template, so
the byte and HF tokenizers behave alike; ``load_tokenizer(path, template=True)`` instead
encodes as ``transformers``' ``tokenizer(text)`` does, with the tokenizer's own template (a
Llama 3 ``tokenizer.json`` adds ``<|begin_of_text|>`` itself): how prompts to an imported
model are encoded (``triax.hf.tokenizer``).

    >>> load_tokenizer("/nonexistent")
    Traceback (most recent call last):
    ...
    triax.text.hf_tokenizer.TokenizerError: --tokenizer '/nonexistent' does not exist; give ...
"""
from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np
from tokenizers import Tokenizer as _HFTokenizer

FILE, CONFIG = "tokenizer.json", "tokenizer_config.json"
# Fallback names when no tokenizer_config.json says which tokens are BOS/EOS/PAD
# (Llama 3, Llama 2 / Mistral, Gemma, GPT-2 conventions).
_GUESS = {"bos": ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>"),
          "eos": ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>"),
          "pad": ("<pad>", "<|pad|>", "[PAD]")}


class TokenizerError(ValueError):
    """A tokenizer path that cannot be used (missing, unreadable, not a tokenizer)."""


class HFTokenizer:
    """``tokenizers.Tokenizer`` with ``encode``/``decode``/``vocab_size``/special ids."""

    def __init__(self, tok: _HFTokenizer, specials: dict, source: str = "",
                 template: bool = False):
        self.tok, self.source, self.template = tok, source, template
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        ids = {k: _token_id(tok, specials.get(k), _GUESS[k]) for k in _GUESS}
        self.bos_id, self.eos_id = ids["bos"], ids["eos"]
        self.pad_id = ids["pad"] if ids["pad"] is not None else self.eos_id

    def encode(self, text: str | bytes, bos: bool = False, eos: bool = False) -> np.ndarray:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        ids = self.tok.encode(text, add_special_tokens=self.template).ids
        for want, tid, name in ((bos, self.bos_id, "BOS"), (eos, self.eos_id, "EOS")):
            if want and tid is None:
                raise TokenizerError(f"tokenizer {self.source!r} has no {name} token; add "
                                     f"{name.lower()}_token to its {CONFIG}")
        return np.asarray(([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else []),
                          np.int32)

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in np.asarray(ids).reshape(-1)],
                               skip_special_tokens=True)

    def __repr__(self):
        return f"HFTokenizer({self.source!r}, vocab_size={self.vocab_size})"


def load_tokenizer(path: str, template: bool = False) -> HFTokenizer:
    """Load ``path`` (a directory with ``tokenizer.json``, or the file); clear errors.
    ``template``: ``encode`` applies the tokenizer's own template (see the module doc)."""
    hint = f"give a directory holding {FILE}, or the {FILE} file"
    if not os.path.exists(path):
        raise TokenizerError(f"--tokenizer {path!r} does not exist; {hint}")
    file = os.path.join(path, FILE) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise TokenizerError(f"--tokenizer {path!r} has no {FILE}; {hint}")
    try:
        tok = _HFTokenizer.from_file(file)
    except Exception as e:  # the Rust side raises a bare Exception on bad JSON
        raise TokenizerError(f"--tokenizer {file!r} is not a valid {FILE} ({e}); {hint}") \
            from None
    return HFTokenizer(tok, _specials(os.path.dirname(os.path.abspath(file))), file, template)


def _specials(directory: str) -> dict:
    """BOS/EOS/PAD token strings from ``tokenizer_config.json`` (a string or {"content": …})."""
    cfg = os.path.join(directory, CONFIG)
    if not os.path.isfile(cfg):
        return {}
    try:
        with open(cfg, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{cfg!r} is not valid JSON ({e}); fix or remove it") from None
    out = {}
    for k in _GUESS:
        v = data.get(f"{k}_token")
        out[k] = v.get("content") if isinstance(v, dict) else v
    return out


def _token_id(tok: _HFTokenizer, named: Optional[str], guesses) -> Optional[int]:
    for name in ((named,) if named else guesses):
        tid = tok.token_to_id(name)
        if tid is not None:
            return int(tid)
    return None
