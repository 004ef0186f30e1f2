"""Function calling: ``tools`` rendered by the chat template (as Hugging Face passes them,
``tools=[{"type": "function", "function": {...}}]``) and the model's calls parsed into
``message.tool_calls``, in the two formats open models use:

* **Hermes** (Qwen, Hermes, many fine-tunes; templates that name ``<tool_call>``):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, text before
  them is the content;
* **Llama 3.1 JSON** (the rest): the whole answer is ``{"name": ..., "parameters": {...}}``
  (``arguments`` also read), optionally after ``<|python_tag|>``.

``tool_choice``: ``auto`` (the default with tools) parses the answer; ``none`` renders the
tools and parses nothing; ``required`` or a named function constrains decoding to one call,
a JSON object ``{"name", "parameters"}`` of a given tool, by the grammar of structured output
(``serving.structured``), and parses it.

    >>> parse('Sure.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', HERMES)
    ('Sure.', [{'name': 'f', 'arguments': '{"x": 1}'}])
    >>> parse('<|python_tag|>{"name": "f", "parameters": {"x": 1}}', LLAMA_JSON)
    ('', [{'name': 'f', 'arguments': '{"x": 1}'}])
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Optional

HERMES, LLAMA_JSON = "hermes", "llama3_json"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def format_of(template_source: str) -> str:
    """The call format a chat template teaches its model."""
    return HERMES if "<tool_call>" in template_source else LLAMA_JSON


def _call(obj) -> Optional[dict]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"name": obj["name"],
            "arguments": args if isinstance(args, str) else json.dumps(args)}


def parse(text: str, fmt: str) -> tuple[str, list[dict]]:
    """(content, calls) of a model's answer: each call ``{"name", "arguments"}`` (arguments
    as a JSON string, as OpenAI gives them); no call found: (text, [])."""
    if fmt == HERMES:
        calls = []
        for body in _HERMES_CALL.findall(text):
            try:
                call = _call(json.loads(body))
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        return (text[:text.index("<tool_call>")].strip(), calls) if calls else (text, [])
    body = text.strip().removeprefix("<|python_tag|>").strip()
    try:
        call = _call(json.loads(body)) if body.startswith("{") else None
    except ValueError:
        call = None
    return ("", [call]) if call else (text, [])


def forced_schema(tools: list[dict], choice) -> dict:
    """The JSON schema one call must follow under ``tool_choice`` ``required`` (any tool) or
    a named function (that one)."""
    def one(f):
        return {"type": "object", "additionalProperties": False,
                "required": ["name", "parameters"],
                "properties": {"name": {"const": f["name"]},
                               "parameters": f.get("parameters") or {"type": "object"}}}
    fns = [t["function"] for t in tools]
    if isinstance(choice, dict):
        return one(next(f for f in fns if f["name"] == choice["function"]["name"]))
    return {"anyOf": [one(f) for f in fns]}


def openai_calls(calls: list[dict]) -> list[dict]:
    """``message.tool_calls`` entries (each with a fresh id)."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
