"""What every tool-call parser provides."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object


# blank characters in a row the grammar lets a constrained call's arguments hold: a model's
# own spacing and indentation pass, an endless run of blanks does not
MAX_CALL_BLANKS = 16

# A function's call as a constrained call format sees it: its name and the schema its
# arguments follow (`{"type": "object"}`, any object, for a function that is not strict).
CallSchema = tuple[str, dict[str, Any]]


class ToolParser:
    """Finds a model's tool calls in its output text.

    `parse(text)` returns the text outside the calls (the message content) and the calls;
    `call_start(text)` the index where a call begins or may begin (its marker, whole or cut
    off at the end of `text`), -1 where none can, so a stream holds back only what may turn
    out to be a call. `constrained(...)` is the format as a grammar (strict functions under
    `tool_choice: "auto"`)."""

    name = ""
    markers: tuple[str, ...] = ()
    # the marker is a special token, which decoding drops unless told to keep it
    needs_special_tokens = False
    # markers a constrained call writes, which may be special tokens (`marker`)
    spelled: tuple[str, ...] = ()

    def __init__(self, tokens: Mapping[str, int] | None = None) -> None:
        # the tokenizer's special tokens among `spelled`, by text
        self.tokens = dict(tokens or {})

    def marker(self, text: str) -> dict[str, Any]:
        """`text` in a structural tag: its special token where the tokenizer has one (the
        grammar engine's vocabulary gives it bytes no text holds, so only this produces it),
        else the text."""
        if text in self.tokens:
            return {"type": "token", "token": self.tokens[text]}
        return {"type": "const_string", "value": text}

    def constrained(self, calls: list[CallSchema], parallel: bool,
                    answer: dict[str, Any] | None) -> dict[str, Any]:
        """The output as a structural tag format (xgrammar's): free text, or `answer` (a
        format) where the request has a response_format, and calls in this format, each
        naming one of `calls` with arguments that follow its schema; one call at most
        unless `parallel`."""
        raise NotImplementedError

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


def arguments_format(schema: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments: JSON that follows `schema`, exactly (no property it does not name
    unless it allows more), whatever the spacing within bounds."""
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_CALL_BLANKS}


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
