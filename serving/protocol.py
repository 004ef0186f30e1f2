"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions`` (OpenAI's fields,
strictly typed: unknown fields and wrong types are refused, never coerced) and what the
server needs from them. OpenAI fields this server does not implement are refused by name
(``UNSUPPORTED``); fields clients send with their defaults (``user``, ``metadata``,
``parallel_tool_calls``) are accepted.

    >>> r = CompletionRequest(model="tiny", prompt="Hi", max_tokens=4, stop=["\\n", 257])
    >>> r.stop_strings(), r.stop_ids()
    (['\\n'], (257,))
    >>> CompletionRequest(model="tiny", prompt=[[1, 2], [3]]).prompts()
    [[1, 2], [3]]
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from triax.inference.logprobs import TOP_LOGPROBS

# OpenAI's fields that this server does not implement: a request naming one gets a 400
# saying so (not "unknown field").
UNSUPPORTED = ("suffix", "functions",
               "function_call", "audio", "modalities", "prediction", "web_search_options",
               "reasoning_effort", "service_tier", "store")
MAX_N = 64   # choices one request may ask for (n, best_of)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampled(_Strict):
    """The fields both endpoints share."""

    model: str
    max_tokens: Optional[int] = Field(None, ge=0)   # default 16; 0 only with echo
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)            # 0: no top-k filter (vLLM's extension field)
    priority: int = 0                      # lower first, preempted last (vLLM's extension)
    seed: Optional[int] = Field(None, ge=0, lt=2 ** 31)
    stop: Optional[Union[str, list[Union[str, int]]]] = None  # strings and token ids
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)      # vLLM's extension field
    logit_bias: Optional[dict[str, float]] = None       # token id (as text) -> bias
    min_tokens: int = Field(0, ge=0)                    # vLLM's
    ignore_eos: bool = False                            # vLLM's
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
    # text, texts, token ids, or lists of token ids: each prompt is n choices
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=TOP_LOGPROBS)
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)

    def prompts(self) -> list:
        """Each prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p) if p else [p]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Optional[Union[str, list[TextPart]]] = None   # None: an assistant's tool calls
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None      # an assistant's earlier calls
    tool_call_id: Optional[str] = None                     # a tool's answer to one

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else \
            "".join(p.text for p in self.content or [])

    def for_template(self) -> dict:
        """The message as chat templates read it (Hugging Face's shape)."""
        out = {"role": self.role, "content": self.text()}
        out.update({k: v for k, v in (("name", self.name), ("tool_calls", self.tool_calls),
                                       ("tool_call_id", self.tool_call_id)) if v is not None})
        return out


class Function(_Strict):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(_Strict):
    type: Literal["function"]
    function: Function


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(_Strict):
    name: str = "response"
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Strict):
    """``text``, ``json_object`` or ``json_schema`` (``serving.structured``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None


class ChatRequest(_Sampled):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=TOP_LOGPROBS)
    parallel_tool_calls: Optional[bool] = None   # accepted: no tools here, nothing to call
    metadata: Optional[dict[str, str]] = None
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None


class TokenizeRequest(_Strict):
    """vLLM's ``/tokenize``: a ``prompt`` (with the tokenizer's special tokens unless
    ``add_special_tokens`` is false) or chat ``messages`` (rendered by the chat template)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[Message]] = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Strict):
    """vLLM's ``/detokenize``: token ids back to text."""

    model: Optional[str] = None
    tokens: list[int]
