"""Token ids to text as they arrive: each step emits only text that is final, holding back
an incomplete UTF-8 character and any tail that could still grow into a ``stop`` string;
a stop string ends the text just before it (OpenAI's rule: the stop string is not returned).

    >>> from triax.text.byte_tokenizer import ByteTokenizer
    >>> d = Detokenizer(ByteTokenizer(), stop=["lo w"])
    >>> [d.push(t) for t in b"hello world"][:5], d.stopped, d.text
    (['h', 'e', '', 'l', ''], True, 'hel')
"""
from __future__ import annotations

from typing import Sequence


class Detokenizer:
    """One request's generated text, grown a token at a time (see the module doc)."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.tokens: list[int] = []
        self.text = ""          # emitted so far
        self.stopped = False    # a stop string was generated

    def _decoded(self) -> str:
        return self.tokenizer.decode(self.tokens)

    def push(self, token: int) -> str:
        """Add one generated token; return the newly final text ('' while held back)."""
        if self.stopped:
            return ""
        self.tokens.append(int(token))
        full = self._decoded()
        hits = [i for i in (full.find(s, max(0, len(self.text) - len(s))) for s in self.stop)
                if i >= 0]
        if hits:
            self.stopped = True
            return self._emit(full[:min(hits)])
        safe = len(full.rstrip("\ufffd"))  # an incomplete character decodes as U+FFFD
        for s in self.stop:  # the longest tail that is a prefix of a stop string
            for k in range(min(len(s) - 1, safe), 0, -1):
                if full[:safe].endswith(s[:k]):
                    safe = min(safe, len(full[:safe]) - k)
                    break
        return self._emit(full[:max(safe, len(self.text))])

    def flush(self) -> str:
        """The held-back text once generation has ended (nothing after a stop string)."""
        return "" if self.stopped else self._emit(self._decoded())

    def _emit(self, upto: str) -> str:
        delta, self.text = upto[len(self.text):], upto
        return delta
