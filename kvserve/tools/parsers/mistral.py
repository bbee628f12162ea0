"""Mistral calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
`[TOOL_CALLS]name[ARGS]{...}` repeated for each call."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvserve.tools.parsers.base import (
    MAX_CALL_BLANKS,
    CallSchema,
    ParsedCall,
    ToolParser,
    arguments_format,
    call_from_object,
    decode_json_values,
)

_CALLS, _ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralParser(ToolParser):
    name = "mistral"
    markers = (_CALLS,)
    needs_special_tokens = True
    spelled = (_CALLS, _ARGS)

    def __init__(self, args_format: bool = False, tokens: Mapping[str, int] | None = None) -> None:
        super().__init__(tokens)
        # which format the model writes (and a constrained call takes): `name[ARGS]{...}`
        # (templates that render [ARGS]) or a JSON list of calls
        self.args_format = args_format

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        i = text.find(_CALLS)
        if i == -1:
            return text, []
        calls = self._calls(text[i:])
        if not calls:
            return text, []
        return text[:i], calls

    def _calls(self, text: str) -> list[ParsedCall]:
        parts = [p for p in text.split(_CALLS) if p.strip()]
        calls: list[ParsedCall] = []
        for part in parts:
            if _ARGS in part:  # name[ARGS]{...}
                name, _, args = part.partition(_ARGS)
                try:
                    obj = {"name": name.strip(), "arguments": json.loads(args)}
                except json.JSONDecodeError:
                    return []
                found = [call_from_object(obj)]
            else:
                values = decode_json_values(part.strip())
                if not values:
                    return []
                flat = [v for x in values for v in (x if isinstance(x, list) else [x])]
                found = [call_from_object(v) for v in flat]
            if not found or any(c is None for c in found):
                return []
            calls.extend(found)  # type: ignore[arg-type]
        return calls

    def constrained(self, calls: list[CallSchema], parallel: bool,
                    answer: dict[str, Any] | None) -> dict[str, Any]:
        start = self.marker(_CALLS)
        if self.args_format:
            one = {"type": "or", "elements": [
                {"type": "sequence", "elements": [{"type": "const_string", "value": name},
                                                  self.marker(_ARGS), arguments_format(schema)]}
                for name, schema in calls]}
            rest: list[dict[str, Any]] = [one]
            if parallel:
                rest.append({"type": "star", "content": {"type": "sequence",
                                                         "elements": [start, one]}})
        else:
            items = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                      "required": ["name", "arguments"]} for name, schema in calls]
            listed: dict[str, Any] = {"type": "array", "minItems": 1,
                                      "items": items[0] if len(items) == 1 else {"anyOf": items}}
            if not parallel:
                listed["maxItems"] = 1
            # v0.3's template writes "[TOOL_CALLS] [": the model may put a blank first
            rest = [{"type": "regex", "pattern": " ?"},
                    {"type": "json_schema", "json_schema": listed,
                     "max_whitespace_cnt": MAX_CALL_BLANKS}]
        after = {"type": "sequence", "elements": rest}
        if answer is None:
            # free text until the marker (its token, or its text in plain tokens), then the
            # calls, which end the message: text after them would make them content again
            return {"type": "dispatch", "rules": [[_CALLS, after]], "loop": False}
        return {"type": "or", "elements": [answer, {"type": "sequence",
                                                     "elements": [start, after]}]}
