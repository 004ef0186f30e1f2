"""The positions a request fills in the KV cache, and the one check that they fit: the
engine's ``check_prompt`` asks it, and serving answers its ``ContextLengthError`` with
OpenAI's ``context_length_exceeded``.

    >>> positions_needed(5, 3)          # the last new token is returned, never fed back
    7
    >>> try:
    ...     check_context(5, 30, max_len=32, model_len=256)
    ... except ContextLengthError as e:
    ...     print(e.fits, str(e)[:58])
    28 prompt of 5 tokens plus max_new_tokens=30 does not fit the
"""
from __future__ import annotations

from triax.inference.errors import ContextLengthError


def positions_needed(n_tokens: int, max_new_tokens: int) -> int:
    """Cache positions a request may fill: its prompt and every fed-back token."""
    return n_tokens + max(max_new_tokens, 1) - 1


def check_context(n_tokens: int, max_new_tokens: int, max_len: int, model_len: int) -> None:
    """Raise ``ContextLengthError`` unless a prompt of ``n_tokens`` and ``max_new_tokens``
    new tokens fit a cache of ``max_len`` positions (``model_len``: the model's context,
    the most ``max_len`` may be)."""
    if n_tokens > model_len:
        raise ContextLengthError(f"prompt of {n_tokens} tokens is longer than the model's "
                                 f"context ({model_len}); shorten it", fits=0)
    need = positions_needed(n_tokens, max_new_tokens)
    if need <= max_len:
        return
    # Raising max_len helps only below the model's context.
    longer = f", or raise max_len (--max-len, at most {model_len})" if max_len < model_len else ""
    fits = max_len - n_tokens + 1
    if fits < 1:
        raise ContextLengthError(f"prompt of {n_tokens} tokens is longer than the context of "
                                 f"{max_len} cached positions; shorten the prompt{longer}",
                                 fits=0)
    raise ContextLengthError(f"prompt of {n_tokens} tokens plus max_new_tokens="
                             f"{max_new_tokens} does not fit the context of {max_len} cached "
                             f"positions; "
                             f"lower max_new_tokens to at most {fits} or shorten the "
                             f"prompt{longer}", fits=fits)
