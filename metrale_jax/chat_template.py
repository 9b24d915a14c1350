"""A checkpoint's chat template, rendered as transformers renders it.

Owns: `ChatTemplate` (the template's source, compiled, and the special-token names it sees),
`load_chat_template` (from `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`)
and `chat_messages` (the conversation `generate --chat` sends: an optional system turn, then the
user's prompt).

Invariants:
- The environment is transformers' (`apply_chat_template` in transformers 5.x): jinja2's
  `ImmutableSandboxedEnvironment` with `trim_blocks` and `lstrip_blocks`, the `loopcontrols`
  extension, a `tojson` filter that keeps non-ASCII (`ensure_ascii=False`), and the globals
  `raise_exception`, `strftime_now`, `dict` and `namespace`; the template sees `messages`, `tools`,
  `documents`, `add_generation_prompt`, the special-token names of tokenizer_config.json (as
  transformers' `special_tokens_map`) and any other variable the caller passes (e.g.
  `enable_thinking`), which override the token names. Messages are copied with their None values
  dropped and their reasoning aliased (`reasoning_content` / `thinking` / `reasoning`), as there.
  tests/test_chat_template.py checks the text against transformers' recorded output.
- A template that does not compile, or fails to render (a `raise_exception`, an undefined
  operation, a sandbox refusal), is one `ChatTemplateError` line; only text files are read.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from metrale_jax.errors import MetraleError, read_text
from metrale_jax.tokenizer import TOKENIZER_CONFIG_FILE, special_token_names

CHAT_TEMPLATE_FILE = "chat_template.jinja"
#: The names a message's reasoning travels under; templates read `reasoning_content` (gpt-oss ones `thinking`).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(MetraleError, ValueError):
    """A chat template that is missing, does not compile, or fails to render."""


def _raise_exception(message: object) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _environment():
    import jinja2.ext
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = dict
    env.globals["namespace"] = jinja2.utils.Namespace
    return env


def _one_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """`source`: the jinja text; `origin`: the file it came from (for errors); `special_tokens`:
    the names the template sees as variables (e.g. eos_token)."""

    source: str
    origin: str
    special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self._compiled()  # a template that does not compile is refused at load

    def _compiled(self):
        import jinja2

        try:
            return _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            where = f"line {e.lineno}: {e.message}"
            raise ChatTemplateError(f"{self.origin}: the chat template does not compile ({where})") from None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **variables: Any,
    ) -> str:
        """The text of `messages` (role / content dicts) as transformers' `apply_chat_template(...,
        tokenize=False)` gives it. `variables` are the template's own (enable_thinking, ...).
        Raises ChatTemplateError (one line) when rendering fails."""
        chat = [_message(m) for m in messages]
        try:
            return self._compiled().render(
                messages=chat,
                tools=None if tools is None else [dict(t) for t in tools],
                documents=None if documents is None else [dict(d) for d in documents],
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **variables},
            )
        except Exception as e:  # jinja2's errors, and whatever a template's operation raises
            raise ChatTemplateError(f"{self.origin}: the chat template failed to render ({_one_line(e)})") from None


def _message(m: Mapping[str, Any]) -> dict[str, Any]:
    """A message as transformers hands it to the template: None values dropped; a reasoning under
    any of `REASONING_FIELDS` also under `thinking` and `reasoning_content`."""
    out = {k: v for k, v in m.items() if v is not None}
    reasoning = next((out[k] for k in REASONING_FIELDS if out.get(k) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def load_chat_template(directory: str) -> ChatTemplate:
    """The chat template of a checkpoint directory: `chat_template.jinja` when present (it takes
    priority, as in transformers), else tokenizer_config.json's `chat_template` (a string, or a
    list of {name, template} whose "default" is used). Raises ChatTemplateError when there is none
    or it does not compile."""
    names = special_token_names(directory)
    jinja = os.path.join(directory, CHAT_TEMPLATE_FILE)
    if os.path.isfile(jinja):
        return ChatTemplate(read_text(jinja, ChatTemplateError), jinja, names)
    path = os.path.join(directory, TOKENIZER_CONFIG_FILE)
    if not os.path.isfile(path):
        raise ChatTemplateError(
            f"{directory} has no chat template (no {CHAT_TEMPLATE_FILE} or {TOKENIZER_CONFIG_FILE})"
        )
    try:
        raw = json.loads(read_text(path, ChatTemplateError))
    except json.JSONDecodeError as e:
        raise ChatTemplateError(f"{path} is not valid JSON: {e}") from None
    value = raw.get("chat_template") if isinstance(raw, dict) else None
    if isinstance(value, list):
        value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(value, str):
        raise ChatTemplateError(f"{path} has no chat_template (and there is no {CHAT_TEMPLATE_FILE})")
    return ChatTemplate(value, path, names)


def chat_messages(prompt: str, system: str | None = None) -> list[dict[str, str]]:
    """The conversation of one request: `system` (when given) as the system turn, then `prompt` as
    the user's."""
    head = [] if system is None else [{"role": "system", "content": system}]
    return [*head, {"role": "user", "content": prompt}]
