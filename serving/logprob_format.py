"""Log-probabilities in OpenAI's two shapes: ``/v1/completions``' ``tokens``,
``token_logprobs``, ``top_logprobs`` (the top ``k`` and always the sampled token: up to
``k + 1`` entries; of ids that decode to one text, the likeliest) and ``text_offset``; and ``/v1/chat/completions``' ``content`` list of
``{token, logprob, bytes, top_logprobs}``. A token's text is what it adds in context (the
text of the few tokens before it and it, less theirs), so the pieces join into the text and
``text_offset`` indexes it (with ``echo``, the prompt's text first).

    >>> from triax.text.byte_tokenizer import ByteTokenizer
    >>> w = LogprobWriter(ByteTokenizer(), list(b"Hi"), k=1)
    >>> out = w.completion([(33, {"logprob": -0.5, "top": [(63, -0.25)]})])
    >>> out["tokens"], out["token_logprobs"], out["top_logprobs"], out["text_offset"]
    (['!'], [-0.5], [{'?': -0.25, '!': -0.5}], [0])
"""
from __future__ import annotations

from typing import Optional

WINDOW = 4   # tokens of context a token's text is decoded in


class LogprobWriter:
    """One choice's log-probabilities, written as its tokens come (streamed or not)."""

    def __init__(self, tokenizer, prompt: list[int], k: int, echo: bool = False):
        self.tokenizer, self.ids, self.k = tokenizer, list(prompt), k
        self.offset = 0                     # characters of the text written so far
        self.echoed = not echo              # the prompt's own entries written (or not wanted)
        self._heads: dict[tuple, str] = {}

    def _decode(self, ids) -> str:
        key = tuple(ids)
        if key not in self._heads:
            self._heads[key] = self.tokenizer.decode(list(ids))
        return self._heads[key]

    def piece(self, i: int, token: Optional[int] = None) -> str:
        """The text ``token`` (default: the token at ``i``) adds after the tokens before i.
        A character split over tokens counts for the token that completes it (the tokens
        before it add ''), so the pieces of a sequence join into its text; an alternative
        that would leave one incomplete reads U+FFFD."""
        before = self.ids[max(0, i - WINDOW):i]
        full = self.tokenizer.decode(before + [self.ids[i] if token is None else token])
        if token is None and i < len(self.ids) - 1:   # (the text may end incomplete)
            full = full.rstrip("\ufffd")
        return full[len(self._decode(before).rstrip("\ufffd")):]

    def _rows(self, start: int, entries: list) -> list[tuple[int, str, Optional[dict]]]:
        return [(i, self.piece(i), e) for i, e in enumerate(entries, start)]

    def prompt_rows(self, prompt_logprobs: Optional[list]) -> list:
        """The prompt's rows (the first token has no log-probability)."""
        self.echoed = True
        return self._rows(0, [None] + list(prompt_logprobs or [None] * (len(self.ids) - 1)))

    def token_rows(self, tokens: list[tuple[int, Optional[dict]]]) -> list:
        start = len(self.ids)
        self.ids += [t for t, _ in tokens]
        return self._rows(start, [e for _, e in tokens])

    def completion(self, tokens: list, prompt_logprobs: Optional[list] = None) -> dict:
        """``/v1/completions``' ``logprobs`` for these new ``(token, entry)`` pairs (and the
        prompt's first, with ``echo``, until written)."""
        rows = [] if self.echoed else self.prompt_rows(prompt_logprobs)
        rows += self.token_rows(tokens)
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, text, e in rows:
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if e is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(e["logprob"])
            top: dict = {}
            for a, lp in e["top"][:self.k]:   # two ids with one text: the likelier's
                top.setdefault(self.piece(i, a), lp)
            top.setdefault(text, e["logprob"])   # the sampled token's, always
            out["top_logprobs"].append(top)
        return out

    def chat(self, tokens: list) -> list[dict]:
        """``/v1/chat/completions``' ``logprobs.content`` entries for these tokens."""
        def item(text, lp):
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
        return [{**item(text, e["logprob"]),
                 "top_logprobs": [item(self.piece(i, a), lp) for a, lp in e["top"][:self.k]]}
                for i, text, e in self.token_rows(tokens)]
