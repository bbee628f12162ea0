"""Hermes / Qwen2 calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
(also kvserve's default tools prompt asks for these)."""

from __future__ import annotations

import json
import re
from typing import Any

from kvserve.tools.parsers.base import (
    CallSchema,
    ParsedCall,
    ToolParser,
    arguments_format,
    call_from_object,
)

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

    def constrained(self, calls: list[CallSchema], parallel: bool,
                    answer: dict[str, Any] | None) -> dict[str, Any]:
        # the block as the tools prompt and Qwen's template write it; `<tool_call>` anywhere
        # in free text starts one
        tags = [{"type": "tag", "begin": f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": ',
                 "content": arguments_format(schema), "end": "}\n</tool_call>"}
                for name, schema in calls]
        if answer is None:
            return {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags,
                    "stop_after_first": not parallel}
        # a response_format: the answer in that format, or calls only
        blocks = {"type": "tags_with_separator", "tags": tags, "separator": "\n",
                  "at_least_one": True, "stop_after_first": not parallel}
        return {"type": "or", "elements": [answer, blocks]}
