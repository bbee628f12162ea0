"""Hermes / Qwen2 calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
(also kvserve's default tools prompt asks for these)."""

from __future__ import annotations

import json
import re

from kvserve.tools.parsers.base import ParsedCall, ToolParser, call_from_object

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        calls: list[ParsedCall] = []
        content: list[str] = []
        pos = 0
        for m in _BLOCK.finditer(text):
            try:
                call = call_from_object(json.loads(m.group(1)))
            except json.JSONDecodeError:
                call = None
            if call is None:  # not a call after all: it stays text
                continue
            content.append(text[pos : m.start()])
            pos = m.end()
            calls.append(call)
        content.append(text[pos:])
        return "".join(content), calls
