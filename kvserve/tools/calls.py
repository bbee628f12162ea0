"""A model's output turned into tool calls, whole or as OpenAI-style streamed deltas.

One `ToolStream` per choice reads the output text as it streams: `feed(delta)` returns the
content to send and the tool-call deltas (a call's first delta has its id and function name,
the following ones fragments of its arguments' JSON text), `finish()` the rest. An
unstreamed answer is the same stream fed all at once, so the deltas of a streamed answer
join to exactly its unstreamed calls.

- Forced calls (`required` or a named function): the text is the grammar's JSON array
  `[{"name": ..., "arguments": {...}}, ...]`; a small scanner follows its structure and
  sends each call's name once it is complete and its arguments text as it grows.
- `auto`: the model's own format (`parsers/`). Content streams until text that may start a
  call; from there the output is held and parsed at the end.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from kvserve.tools.parsers.base import ToolParser


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # the arguments object as JSON text


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None  # set on a call's first delta, with its name
    name: str | None = None
    arguments: str = ""


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class _ForcedScanner:
    """Follows `[{"name": "...", "arguments": {...}}, ...]` character by character."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0
        self.depth = 0
        self.in_string = False
        self.escape = False
        # inside a call object (depth 2): the key being read, and where its value began
        self.key: str | None = None
        self.key_start = -1
        self.value_start = -1
        self.calls: list[dict] = []  # {"id", "name", "args_start", "args_end", "sent"}

    def feed(self, delta: str) -> list[ToolCallDelta]:
        self.text += delta
        t = self.text
        while self.pos < len(t):
            self._step(t, self.pos, t[self.pos])
            self.pos += 1
        return self._deltas()

    def finish(self) -> list[ToolCallDelta]:
        """The rest; arguments cut off (the output hit its length) end where the text does."""
        if self.key == "arguments" and self.value_start >= 0 and self.calls:
            end = len(self.text.rstrip())
            self.calls[-1]["args_start"], self.calls[-1]["args_end"] = self.value_start, end
        return self._deltas()

    def _step(self, t: str, i: int, c: str) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                if self.depth == 2 and self.key_start >= 0 and self.value_start < 0:
                    self.key = json.loads(t[self.key_start : i + 1])
                    self.key_start = -1
            return
        if c == '"':
            self.in_string = True
            if self.depth == 2 and self.value_start < 0 and self.key is None:
                self.key_start = i
            elif self.depth == 2 and self.value_start < 0:
                self.value_start = i
            return
        if c in " \t\r\n":
            return
        if c == ":" and self.depth == 2:
            return
        if self.depth == 2 and self.key is not None and self.value_start < 0 and c not in ",}":
            self.value_start = i
        if c in "[{":
            self.depth += 1
            if self.depth == 2:
                self.calls.append({"id": new_call_id(), "name": None, "args_start": -1,
                                   "args_end": -1, "sent": 0, "announced": False})
                self.key, self.value_start = None, -1
            return
        if c in "]}":
            if self.depth == 2:
                self._end_value(i)
            self.depth -= 1
            return
        if c == "," and self.depth == 2:
            self._end_value(i)

    def _end_value(self, end: int) -> None:
        if self.key is not None and self.value_start >= 0 and self.calls:
            call = self.calls[-1]
            raw = self.text[self.value_start : end].rstrip()
            if self.key == "name":
                try:
                    call["name"] = json.loads(raw)
                except json.JSONDecodeError:
                    call["name"] = raw
            elif self.key == "arguments":
                call["args_start"], call["args_end"] = self.value_start, self.value_start + len(raw)
        self.key, self.value_start = None, -1

    def _deltas(self) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        last = len(self.calls) - 1
        for i, call in enumerate(self.calls):
            if call["name"] is None:
                continue  # a call is announced once its name is whole
            if not call["announced"]:
                call["announced"] = True
                out.append(ToolCallDelta(i, call["id"], call["name"]))
            if call["args_end"] >= 0:
                start, end = call["args_start"], call["args_end"]
            elif i == last and self.key == "arguments" and self.value_start >= 0:
                # still arriving: send what is there (trailing blanks may end the value)
                start, end = self.value_start, len(self.text.rstrip())
            else:
                continue
            frag = self.text[start + call["sent"] : end]
            if frag:
                call["sent"] += len(frag)
                out.append(ToolCallDelta(i, arguments=frag))
        return _merge(out)

    def result(self) -> list[ToolCall]:
        out = []
        for c in self.calls:
            if c["name"] is None:
                continue
            args = self.text[c["args_start"] : c["args_end"]] if c["args_start"] >= 0 else "{}"
            out.append(ToolCall(c["id"], c["name"], args))
        return out


class ToolStream:
    """One choice's output as content and tool calls; see the module's docstring."""

    def __init__(self, forced: bool, parser: ToolParser) -> None:
        self.forced = forced
        self.parser = parser
        self._scanner = _ForcedScanner() if forced else None
        self._buf = ""
        self._sent = 0  # content characters sent (auto)
        self._held = False  # a call has begun for certain: hold the rest (auto)
        self.calls: list[ToolCall] = []
        self.content = ""

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        if self._scanner is not None:
            return "", self._scanner.feed(delta)
        self._buf += delta
        if self._held:
            return "", []
        start = self.parser.call_start(self._buf[self._sent :])
        end = len(self._buf) if start < 0 else self._sent + start
        out = self._buf[self._sent : end]
        self._sent = end
        if start >= 0 and self.parser.started(self._buf[self._sent :]):
            self._held = True
        self.content += out
        return out, []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self._scanner is not None:
            deltas = self._scanner.finish()
            self.calls = self._scanner.result()
            return "", _merge(deltas)
        rest, parsed = self.parser.parse(self._buf[self._sent :])
        self._sent = len(self._buf)
        self.content += rest
        self.calls = [ToolCall(new_call_id(), c.name, c.arguments) for c in parsed]
        deltas = [ToolCallDelta(i, c.id, c.name, c.arguments) for i, c in enumerate(self.calls)]
        return rest, deltas


def _merge(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive deltas of one call as one."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index and d.id is None:
            out[-1].arguments += d.arguments
        else:
            out.append(d)
    return out


def extract(text: str, forced: bool, parser: ToolParser) -> tuple[str, list[ToolCall]]:
    """A whole answer's content and calls (the same as streaming it would give)."""
    ts = ToolStream(forced, parser)
    ts.feed(text)
    ts.finish()
    return ts.content, ts.calls
