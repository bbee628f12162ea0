"""Llama 3.1+ JSON calls: the whole message is `{"name": ..., "parameters": {...}}` (several
separated by ';' or in a list), after an optional `<|python_tag|>`."""

from __future__ import annotations

import json
from typing import Any

from kvserve.tools.parsers.base import (
    CallSchema,
    ParsedCall,
    ToolParser,
    arguments_format,
    call_from_object,
    decode_json_values,
)

_TAG = "<|python_tag|>"
# text that does not start a call: empty or blank, or its first non-blank character is not '{'
_FREE = {"type": "or", "elements": [
    {"type": "regex", "pattern": r"[ \t\r\n]*"},
    {"type": "sequence", "elements": [{"type": "regex", "pattern": r"[ \t\r\n]*[^{ \t\r\n]"},
                                      {"type": "any_text"}]}]}


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = (_TAG,)
    needs_special_tokens = True

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        body = text.strip()
        if body.startswith(_TAG):
            body = body[len(_TAG):]
        values = decode_json_values(body)
        if not values:
            return text, []
        flat = [v for x in values for v in (x if isinstance(x, list) else [x])]
        calls = [call_from_object(v) for v in flat]
        if not calls or any(c is None for c in calls):
            return text, []
        return "", calls  # type: ignore[return-value]

    def call_start(self, text: str) -> int:
        # a call is the whole message: it may start only where the message does
        stripped = text.lstrip()
        if not stripped:
            return 0 if text else -1
        start = len(text) - len(stripped)
        if stripped[0] == "{" or stripped.startswith(_TAG) or _TAG.startswith(stripped):
            return start
        return -1

    def started(self, text: str) -> bool:
        s = text.lstrip()
        return s.startswith("{") or s.startswith(_TAG)

    def constrained(self, calls: list[CallSchema], parallel: bool,
                    answer: dict[str, Any] | None) -> dict[str, Any]:
        # no marker: a call is the whole message, so a message that starts with '{' is calls
        # (separated by "; "), and any other is free text. `<|python_tag|>` (optional before
        # the calls) stays a special token the grammar never produces.
        tags = [{"type": "tag", "begin": f'{{"name": {json.dumps(name)}, "parameters": ',
                 "content": arguments_format(schema), "end": "}"} for name, schema in calls]
        message = {"type": "tags_with_separator", "tags": tags, "separator": "; ",
                   "at_least_one": True, "stop_after_first": not parallel}
        return {"type": "or", "elements": [answer or _FREE, message]}
