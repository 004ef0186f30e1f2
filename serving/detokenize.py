"""Token ids to text as they arrive: each step emits only text that is final, holding back
an incomplete UTF-8 character and any tail that could still grow into a ``stop`` string;
a stop string ends the text just before it (OpenAI's rule: the stop string is not returned).

Each token decodes a short window, not the whole list (vLLM's incremental detokenizer): the
tokens since the text was last whole, with those of the whole piece before as context (a
tokenizer may spell a token differently at the start of a text). So a long answer costs a constant per token, not one growing with its length.
Where a window's text does not extend its context's, the whole list is decoded
(``_decoded``). A byte-fallback tokenizer (Llama 2's) may turn text already final into
U+FFFD when invalid bytes follow it; streamed text is not taken back.

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
        # tokens[:read] decode whole to `whole`; tokens[context:read] are the window's context
        self.whole, self.context, self.read = "", 0, 0

    def _decoded(self) -> str:
        """The text so far: ``whole`` (final) and the window's text after it. A window that
        does not extend its context's text (pieces read more context; or byte-fallback
        pieces of an unfinished character, which spoil the bytes before them too) is checked
        against the whole list's decode, and held back ("\ufffd") unless that extends it."""
        toks = self.tokens
        known = self.tokenizer.decode(toks[self.context:self.read])
        window = self.tokenizer.decode(toks[self.context:])
        if window.startswith(known) or window.endswith("\ufffd"):   # (unfinished: hold)
            tail = window[len(known):] if window.startswith(known) else "\ufffd"
        else:
            full = self.tokenizer.decode(toks)
            tail = full[len(self.whole):] if full.startswith(self.whole) else "\ufffd"
        if tail.endswith("\ufffd"):   # an unfinished character: the window grows
            return self.whole + tail
        # the next window's context: from the last point the text was whole, so that it
        # starts on a character (a byte-fallback piece cut from its character spoils its run)
        self.whole, self.context, self.read = self.whole + tail, self.read, len(toks)
        return self.whole

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
        return "" if self.stopped else self._emit(self.tokenizer.decode(self.tokens))

    def _emit(self, upto: str) -> str:
        delta, self.text = upto[len(self.text):], upto
        return delta
