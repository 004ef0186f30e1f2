"""A model's chat template from its ``tokenizer_config.json``, rendered with jinja2 the way
Hugging Face's ``apply_chat_template`` renders it: a sandboxed environment with
``trim_blocks`` and ``lstrip_blocks``, ``raise_exception`` and ``tojson`` available, the
tokenizer's special tokens as variables, and ``add_generation_prompt``.

    >>> t = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    ...                  "{% if add_generation_prompt %}<assistant>{% endif %}", bos_token="<s>")
    >>> t.render([{"role": "user", "content": "Hi"}])
    '<user>Hi<assistant>'
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Optional

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

CONFIG, JINJA = "tokenizer_config.json", "chat_template.jinja"


class ChatTemplateError(ValueError):
    """A template that is missing, does not parse, or raised while rendering."""


def _raise(message):
    raise ChatTemplateError(message)


class ChatTemplate:
    """One compiled chat template plus the special tokens it may name."""

    def __init__(self, source: str, **special_tokens):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **kw: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the chat template does not parse: {e}") from None
        self.special_tokens, self.source = special_tokens, source

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: Optional[list[dict]] = None) -> str:
        """The prompt text; ``tools`` (OpenAI's tool dicts) as the template's ``tools``."""
        extra = {} if tools is None else {"tools": tools}
        try:
            return self.template.render(messages=messages,
                                        add_generation_prompt=add_generation_prompt,
                                        **extra, **self.special_tokens)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed to render: {e}") from None


def _token_text(tok) -> Optional[str]:
    """A special token in tokenizer_config.json: a string, or an AddedToken dict."""
    return tok.get("content") if isinstance(tok, dict) else tok


def load_chat_template(model_dir: Optional[str]) -> Optional[ChatTemplate]:
    """The chat template of a Hugging Face model directory (``chat_template.jinja``, else
    ``chat_template`` in ``tokenizer_config.json``: a string, or named templates of which
    ``default`` is used), or None when it has none."""
    if model_dir is None:
        return None
    cfg_path = os.path.join(model_dir, CONFIG)
    cfg = {}
    if os.path.isfile(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    source = cfg.get("chat_template")
    if os.path.isfile(os.path.join(model_dir, JINJA)):
        with open(os.path.join(model_dir, JINJA), encoding="utf-8") as f:
            source = f.read()
    if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source}
        source = named.get("default")
    if not source:
        return None
    specials = {k: _token_text(cfg.get(k)) for k in
                ("bos_token", "eos_token", "pad_token", "unk_token")}
    return ChatTemplate(source, **{k: v for k, v in specials.items() if v is not None})
