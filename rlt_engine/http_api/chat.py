"""Chat templates shipped with a checkpoint (Hugging Face layout), rendered with sandboxed Jinja2.

Looked up in the checkpoint directory, first match wins: `chat_template.jinja`,
`chat_template.json` ({"chat_template": …}), `tokenizer_config.json`'s `chat_template` (a string,
or a list of {"name", "template"} of which `default` is used). Toy models have none.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from rlt_engine.checkpoints import resolve_model


class ChatTemplateError(ValueError):
    """A chat template could not be loaded or rendered (the message says why)."""


class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ChatTemplateError(f"the checkpoint's chat template does not compile: {exc}") from None
        self.special_tokens = special_tokens

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               **kwargs: Any) -> str:
        """The prompt text for `messages` (ChatTemplateError when the template refuses them)."""
        from jinja2 import TemplateError

        context = {**self.special_tokens, **kwargs, "messages": messages,
                   "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(context)
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the messages: {exc}") from None


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(model: str) -> ChatTemplate | None:
    """The chat template of checkpoint directory `model`, or None (toy models, no template shipped)."""
    directory = Path(resolve_model(model))
    if model.startswith("toy-") or not directory.is_dir():
        return None
    config: dict[str, Any] = {}
    config_path = directory / "tokenizer_config.json"
    if config_path.exists():
        config = json.loads(config_path.read_text(encoding="utf-8"))
    source: Any = None
    if (directory / "chat_template.jinja").exists():
        source = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    elif (directory / "chat_template.json").exists():
        source = json.loads((directory / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
    else:
        source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str) or not source:
        return None
    specials = {name: text for name in ("bos_token", "eos_token", "pad_token", "unk_token")
                if (text := _token_text(config.get(name))) is not None}
    return ChatTemplate(source, specials)
