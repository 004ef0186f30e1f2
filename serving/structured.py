"""Structured output: ``response_format`` of ``json_object`` or ``json_schema``, decoded
under a grammar. The grammar library is llguidance (the Rust engine behind vLLM's and
SGLang's ``guidance`` backend): it compiles a JSON schema lazily, in microseconds, with no
vocabulary-sized precomputation (outlines-core builds a regex automaton over the whole
vocabulary first; xgrammar needs torch, which triax does not depend on), and fills a
per-step token bitmask in numpy. That bitmask rides in the step's rows and is applied on
device (``inference.penalties.adjust_logits``); each accepted token advances the grammar
(``inference.batching``). JSON is generated without optional whitespace, so a model cannot
spend its tokens on blanks; the request ends (``stop``) when the value is complete.

    >>> fmt = ResponseFormat(type="json_schema", json_schema={"name": "x", "schema": {
    ...     "type": "object", "properties": {"a": {"type": "boolean"}}}})
    >>> json.loads(grammar_for(fmt))["grammars"][0]["json_schema"]["type"]
    'object'
"""
from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np

from triax.serving.errors import APIError
from triax.serving.protocol import ResponseFormat


def schema_grammar(schema: dict) -> str:
    """llguidance's grammar for JSON following ``schema`` (no optional whitespace)."""
    import llguidance
    return llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": False})


def grammar_for(fmt: ResponseFormat) -> Optional[str]:
    """llguidance's grammar for a ``response_format`` (None: plain text)."""
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        schema = {"type": "object"}
    elif fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(400, "response_format json_schema needs json_schema.schema",
                       param="response_format.json_schema", code="invalid_value")
    else:
        schema = fmt.json_schema.schema_
    return schema_grammar(schema)


class Grammar:
    """One choice's grammar state (``inference.penalties.TokenConstraint``)."""

    def __init__(self, tokenizer, grammar: str):
        import llguidance
        import llguidance.numpy as lnp
        self._lnp = lnp
        self.matcher = llguidance.LLMatcher(tokenizer, grammar)
        if self.matcher.is_error():
            raise APIError(400, f"response_format: the schema does not compile: "
                                f"{self.matcher.get_error()}", param="response_format",
                           code="invalid_value")
        self.mask = lnp.allocate_token_bitmask(1, tokenizer.vocab_size)

    def bitmask(self) -> np.ndarray:
        self._lnp.fill_next_token_bitmask(self.matcher, self.mask, 0)
        return self.mask[0]

    def advance(self, token: int) -> None:
        self.matcher.consume_token(int(token))

    @property
    def finished(self) -> bool:
        return self.matcher.is_stopped()


class Grammars:
    """Builds each request's ``Grammar`` over the served model's tokenizer (loaded once)."""

    def __init__(self, tokenizer, vocab_size: int, eos: tuple[int, ...]):
        self.source, self.vocab_size, self.eos = getattr(tokenizer, "source", ""), vocab_size, eos
        self._tok = None

    def _tokenizer(self):
        if self._tok is None:
            import llguidance
            if not (self.source and os.path.isfile(self.source)):
                raise APIError(400, "response_format needs the model's Hugging Face tokenizer "
                                    "(tokenizer.json); this server's tokenizer has none",
                               param="response_format", code="unsupported_field")
            # The vocabulary as the model sees it; an EOS the grammar may end with (a model
            # without one ends when the value is complete).
            self._tok = llguidance.LLTokenizer(self.source, n_vocab=self.vocab_size,
                                               eos_token=list(self.eos) or None)
        return self._tok

    def make(self, fmt: ResponseFormat, text: Optional[str] = None) -> Optional[str]:
        """The grammar text for ``fmt`` (or the given ``text``), checked now: a bad schema is
        a 400 before any run."""
        text = grammar_for(fmt) if text is None else text
        if text is not None:
            Grammar(self._tokenizer(), text)
        return text

    def state(self, grammar: str) -> Grammar:
        return Grammar(self._tokenizer(), grammar)
