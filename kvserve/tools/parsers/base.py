"""What every tool-call parser provides."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object


class ToolParser:
    """Finds a model's tool calls in its output text.

    `parse(text)` returns the text outside the calls (the message content) and the calls;
    `call_start(text)` the index where a call begins or may begin (its marker, whole or cut
    off at the end of `text`), -1 where none can, so a stream holds back only what may turn
    out to be a call."""

    name = ""
    markers: tuple[str, ...] = ()
    # the marker is a special token, which decoding drops unless told to keep it
    needs_special_tokens = False

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        raise NotImplementedError

    def call_start(self, text: str) -> int:
        best = -1
        for m in self.markers:
            i = text.find(m)
            if i == -1:
                i = _partial_suffix(text, m)
            if i != -1 and (best == -1 or i < best):
                best = i
        return best

    def started(self, text: str) -> bool:
        """Whether `text` holds a whole marker (a call has begun for certain)."""
        return any(m in text for m in self.markers)


def _partial_suffix(text: str, marker: str) -> int:
    """Where a proper prefix of `marker` ends `text`, or -1."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return len(text) - n
    return -1


def call_from_object(obj: Any) -> ParsedCall | None:
    """`{"name": ..., "arguments" | "parameters": {...}}` -> a call; None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def decode_json_values(text: str) -> list[Any] | None:
    """Every JSON value in `text`, one after another (separated by whitespace, ',' or ';');
    None unless the whole text is such values."""
    dec = json.JSONDecoder()
    out, i, n = [], 0, len(text)
    while True:
        while i < n and text[i] in " \t\r\n,;":
            i += 1
        if i >= n:
            return out
        try:
            value, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        out.append(value)
