"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions`` (OpenAI's fields,
strictly typed: unknown fields and wrong types are refused, never coerced) and what the
server needs from them.

    >>> r = CompletionRequest(model="tiny", prompt="Hi", max_tokens=4, stop=["\\n", 257])
    >>> r.stop_strings(), r.stop_ids()
    (['\\n'], (257,))
"""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampled(_Strict):
    """The fields both endpoints share."""

    model: str
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)            # 0: no top-k filter (vLLM's extension field)
    priority: int = 0                      # lower first, preempted last (vLLM's extension)
    seed: Optional[int] = Field(None, ge=0, lt=2 ** 31)
    stop: Optional[Union[str, list[Union[str, int]]]] = None  # strings and token ids
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = 1
    user: Optional[str] = None

    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in stop if isinstance(s, str) and s]

    def stop_ids(self) -> tuple[int, ...]:
        return tuple(s for s in (self.stop or []) if isinstance(s, int))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampled):
    prompt: Union[str, list[int]]          # text, or token ids


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[TextPart]]
    name: Optional[str] = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else \
            "".join(p.text for p in self.content)


class ChatRequest(_Sampled):
    messages: list[Message] = Field(min_length=1)
