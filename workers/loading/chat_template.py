"""Rendering a model's Jinja chat template the way transformers does.

The environment mirrors transformers' `apply_chat_template` (sandboxed, trim_blocks, lstrip_blocks,
`raise_exception`, a non-escaping `tojson`, `strftime_now`, loop controls, `{% generation %}`) so a
prompt rendered here is byte-identical to the one the model was tuned on.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvserve.errors import InvalidRequestError

# Message fields a model's reasoning may arrive under; templates read the first two.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Templates that inspect or iterate `content` can take OpenAI-style lists of parts as-is; any
# other template concatenates content as a string, so parts must be joined first.
_HANDLES_CONTENT_LISTS = re.compile(
    r"""content['"]?\]?\s*is\s+(?:not\s+)?(?:string|iterable|sequence|mapping)"""
    r"""|\bfor\s+\w+\s+in\s+[\w.]*(?:\[['"]content['"]\]|\.content)\b"""
)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks.

    Serving only needs the text, so the block renders its body unchanged.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes `<` and `&`, which would change tool schemas in the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile (once per distinct source) a chat template; raises jinja2.TemplateSyntaxError."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _text_of_parts(parts: list[Any], index: int) -> list[str]:
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequestError(
                f"messages[{index}].content: only text parts are supported, got {kind!r}"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequestError(
                f"messages[{index}].content: a text part needs a string 'text'"
            )
        texts.append(text)
    return texts


def normalize_messages(messages: Any, template: str) -> list[dict[str, Any]]:
    """Validated copies of `messages`, shaped for `template`.

    Drops None-valued keys (as transformers does, so `content: null` from OpenAI clients reads as
    absent) and joins text parts with newlines for templates that expect string content.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of message objects")
    joins_parts = _HANDLES_CONTENT_LISTS.search(template) is None
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(
                f"messages[{i}] must be an object, got {type(message).__name__}"
            )
        msg = {k: v for k, v in message.items() if v is not None}
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"messages[{i}] needs a non-empty string 'role'")
        content = msg.get("content")
        if isinstance(content, list):
            texts = _text_of_parts(content, i)
            msg["content"] = (
                "\n".join(texts) if joins_parts else [{"type": "text", "text": t} for t in texts]
            )
        elif content is None:
            # An assistant turn that only calls tools legitimately has no content.
            if not msg.get("tool_calls"):
                raise InvalidRequestError(f"messages[{i}] ({role}) needs 'content'")
        elif not isinstance(content, str):
            raise InvalidRequestError(
                f"messages[{i}].content must be a string or a list of text parts, "
                f"got {type(content).__name__}"
            )
        reasoning = next((msg[k] for k in _REASONING_FIELDS if k in msg), None)
        if reasoning is not None:
            msg.setdefault("thinking", reasoning)
            msg.setdefault("reasoning_content", reasoning)
        out.append(msg)
    return out


def render_chat(
    template: str,
    messages: Any,
    *,
    add_generation_prompt: bool,
    special_tokens: dict[str, str],
    **kwargs: Any,
) -> str:
    """Render `messages` with `template`; bad messages or a template refusal -> InvalidRequestError."""
    msgs = normalize_messages(messages, template)
    variables: dict[str, Any] = {"tools": None, "documents": None, **special_tokens, **kwargs}
    try:
        return compile_template(template).render(
            messages=msgs, add_generation_prompt=add_generation_prompt, **variables
        )
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidRequestError(f"the model's chat template is invalid: {exc}") from exc
    except jinja2.TemplateError as exc:
        # raise_exception() in templates reports conversation-shape problems, e.g. role order.
        raise InvalidRequestError(f"chat template rejected the messages: {exc}") from exc
    except (TypeError, KeyError, IndexError, AttributeError, ValueError) as exc:
        raise InvalidRequestError(
            f"chat template could not render these messages: {type(exc).__name__}: {exc}"
        ) from exc


def select_template(
    templates: dict[str, str], name: str | None = None, tools: Any = None
) -> str | None:
    """Pick a named template like transformers: explicit name, 'tool_use' with tools, 'default'."""
    if name is not None:
        if name in templates:
            return templates[name]
        if "{" in name:  # a literal template passed instead of a name
            return name
        raise InvalidRequestError(
            f"unknown chat template {name!r}; the model has {sorted(templates) or 'none'}"
        )
    if tools and "tool_use" in templates:
        return templates["tool_use"]
    return templates.get("default")
