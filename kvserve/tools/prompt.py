"""Tools and tool messages in a chat prompt.

A template with a tools section gets the tools as its `tools` variable and the messages in
the shape templates expect (a call's arguments as an object, not JSON text). A template
without one (SmolLM2's) gets kvserve's default tools prompt instead: a system message that
lists the functions and asks for Hermes-style `<tool_call>` blocks; earlier calls and tool
results are written into the conversation as those blocks and `<tool_response>` blocks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from kvserve.errors import InvalidRequestError

_MENTIONS_TOOLS = re.compile(r"\btools\b")
_MENTIONS_TOOL_MESSAGES = re.compile(r"\btool_calls\b|['\"]tool['\"]|\btool_call\b")

DEFAULT_TOOLS_PROMPT = (
    "You can call functions. They are listed below as JSON, one per line, inside "
    "<tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with one block per call, each holding a JSON object with the "
    "function's name and its arguments:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n</tool_call>\n'
    "A function's result comes back inside <tool_response></tool_response>."
)


def template_handles_tools(template: str) -> bool:
    """Whether the template renders a `tools` list."""
    return _MENTIONS_TOOLS.search(template) is not None


def template_handles_tool_messages(template: str) -> bool:
    """Whether the template renders assistant tool calls and tool results itself."""
    return _MENTIONS_TOOL_MESSAGES.search(template) is not None


def render_inputs(template: str, messages: Any, tools: list[dict[str, Any]] | None
                  ) -> tuple[Any, list[dict[str, Any]] | None]:
    """The messages and `tools` variable to render `template` with."""
    if not isinstance(messages, list):
        return messages, tools  # refused with a clear message when rendered
    if template_handles_tool_messages(template):
        messages = for_template(messages)
    elif any(isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls"))
             for m in messages):
        messages = plain(messages, None)
    if tools and not template_handles_tools(template):
        return plain(messages, tools), None
    return messages, tools or None


def _arguments(call: Any, i: int) -> tuple[str, Any]:
    if not isinstance(call, Mapping):
        raise InvalidRequestError(f"messages[{i}].tool_calls entries must be objects")
    fn = call.get("function", call)
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise InvalidRequestError(f"messages[{i}].tool_calls entries need function.name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise InvalidRequestError(
                f"messages[{i}].tool_calls: the arguments of {fn['name']!r} are not valid "
                f"JSON: {e}") from None
    return fn["name"], args


def for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that renders tool calls: OpenAI's arguments JSON text becomes
    the object templates expect; everything else is left as it is."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls and isinstance(calls, list):
            fixed = []
            for c in calls:
                fn = c.get("function") if isinstance(c, Mapping) else None
                if isinstance(fn, Mapping) and isinstance(fn.get("arguments"), str):
                    _, args = _arguments(c, i)
                    c = {**c, "function": {**fn, "arguments": args}}
                fixed.append(c)
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


def plain(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Messages for a template without a tools section: the default tools prompt in the
    system message, calls and results written as text blocks."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            out.append(m)  # refused with a clear message when rendered
            continue
        role = m.get("role")
        if role == "tool":
            body = _text(m.get("content"))
            out.append({"role": "user",
                        "content": f"<tool_response>\n{body}\n</tool_response>"})
            continue
        calls = m.get("tool_calls")
        if role == "assistant" and calls:
            blocks = []
            for c in calls:
                name, args = _arguments(c, i)
                call = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
                blocks.append(f"<tool_call>\n{call}\n</tool_call>")
            text = _text(m.get("content"))
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = "\n".join(([text] if text else []) + blocks)
        out.append(m)
    if tools:
        listing = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        prompt = DEFAULT_TOOLS_PROMPT.format(tools=listing)
        if out and out[0].get("role") == "system":
            first = dict(out[0])
            first["content"] = f"{_text(first.get('content'))}\n\n{prompt}".lstrip()
            out[0] = first
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return str(content)
