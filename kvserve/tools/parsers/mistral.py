"""Mistral calls: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
`[TOOL_CALLS]name[ARGS]{...}` repeated for each call."""

from __future__ import annotations

import json

from kvserve.tools.parsers.base import ParsedCall, ToolParser, call_from_object, decode_json_values

_CALLS, _ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralParser(ToolParser):
    name = "mistral"
    markers = (_CALLS,)
    needs_special_tokens = True

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
