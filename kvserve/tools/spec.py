"""A request's tools and tool_choice (OpenAI's shapes), checked, and the schema of a forced call.

`required` and a named function are enforced by the grammar engine, so they hold for any
model: the output is then a JSON array of calls, `[{"name": ..., "arguments": {...}}]`,
whose items the schema ties to each function's parameters (one item for a named function
or with `parallel_tool_calls: false`). `auto` leaves the model free and parses its own call
format afterwards; where a function is `strict`, the grammar engine also holds the calls the
model starts in that format to the tools' names and strict functions' arguments to their
schemas (`ToolPlan.auto_structured`). `none` renders the tools but never returns calls.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from kvserve.errors import InvalidRequestError
from kvserve.structured import (
    StructuredOutput,
    as_format,
    json_schema_output,
    structural_tag_output,
)
from kvserve.tools.parsers.base import ToolParser

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
MAX_TOOLS = 128
# calls one forced answer may hold when parallel calls are allowed
MAX_PARALLEL_CALLS = 8

Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class Function:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    strict: bool = False

    def as_tool(self) -> dict[str, Any]:
        """The OpenAI tool object, as chat templates receive it."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for its generation and its answer."""

    functions: tuple[Function, ...]
    mode: Mode
    name: str | None = None  # the named function
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    @property
    def returns_calls(self) -> bool:
        return self.mode != "none" and bool(self.functions)

    @property
    def strict(self) -> bool:
        """Whether `auto` constrains the calls the model starts (a function is strict)."""
        return self.mode == "auto" and any(f.strict for f in self.functions)

    def tools(self) -> list[dict[str, Any]]:
        return [f.as_tool() for f in self.functions]

    def structured(self) -> StructuredOutput | None:
        """The constraint that forces the call(s); None unless `required` or named."""
        if not self.forced:
            return None
        fns = [f for f in self.functions if self.mode == "required" or f.name == self.name]
        items = [_call_schema(f) for f in fns]
        item = items[0] if len(items) == 1 else {"anyOf": items}
        one = self.mode == "named" or not self.parallel
        schema = {"type": "array", "items": item, "minItems": 1,
                  "maxItems": 1 if one else MAX_PARALLEL_CALLS}
        # strict: the arguments name only the parameters' properties (extra keys only where a
        # schema allows them explicitly), as a function called with them expects
        return json_schema_output(schema, strict=True, where="tools")

    def auto_structured(self, parser: ToolParser, answer: StructuredOutput | None
                        ) -> StructuredOutput | None:
        """The constraint of `auto` with strict functions, None without: the model writes
        free text (or its `answer`, the request's response_format) or calls in `parser`'s
        format; a call names one of the functions, and a strict function's arguments follow
        its parameters exactly as a forced call's do (a function that is not strict takes
        any object)."""
        if not self.strict:
            return None
        calls = [(f.name, (f.parameters or {"type": "object", "properties": {}}) if f.strict
                  else {"type": "object"}) for f in self.functions]
        fmt = parser.constrained(calls, self.parallel, as_format(answer) if answer else None)
        return structural_tag_output(fmt)


def _call_schema(f: Function) -> dict[str, Any]:
    params = f.parameters or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": f.name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def parse_tools(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None) -> ToolPlan | None:
    """OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` -> a plan (None: no tools).

    Raises InvalidRequestError naming the field for anything malformed."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice needs tools")
        return None
    if not isinstance(tools, list):
        raise InvalidRequestError(f"tools must be a list, got {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"at most {MAX_TOOLS} tools are accepted, got {len(tools)}")
    fns = tuple(_function(t, i) for i, t in enumerate(tools))
    names = [f.name for f in fns]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise InvalidRequestError(f"tools: the function name {dup!r} is given twice")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequestError("parallel_tool_calls must be a boolean")
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    mode, name = _choice(tool_choice, names)
    return ToolPlan(fns, mode, name, parallel)


def _function(t: Any, i: int) -> Function:
    where = f"tools[{i}]"
    if not isinstance(t, Mapping):
        raise InvalidRequestError(f"{where} must be an object")
    if t.get("type", "function") != "function":
        raise InvalidRequestError(f"{where}.type {t.get('type')!r} is not supported; only "
                                  "'function' tools are")
    fn = t.get("function")
    if not isinstance(fn, Mapping):
        raise InvalidRequestError(f"{where}.function must be an object with a 'name'")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequestError(f"{where}.function.name must be 1-64 letters, digits, '_', "
                                  f"'.' or '-', got {name!r}")
    desc = fn.get("description") or ""
    if not isinstance(desc, str):
        raise InvalidRequestError(f"{where}.function.description must be a string")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if isinstance(params, str):
        try:
            params = json.loads(params)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{where}.function.parameters is not valid JSON: {e}") from None
    if not isinstance(params, Mapping):
        raise InvalidRequestError(f"{where}.function.parameters must be a JSON schema object")
    if params.get("type", "object") != "object":
        raise InvalidRequestError(f"{where}.function.parameters must describe an object "
                                  f"(type 'object'), got type {params.get('type')!r}")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError(f"{where}.function.strict must be a boolean")
    return Function(name, desc, dict(params), bool(strict))


def _choice(choice: Any, names: list[str]) -> tuple[Mode, str | None]:
    if choice is None or choice == "auto":
        return "auto", None
    if choice in ("none", "required"):
        return choice, None
    if isinstance(choice, Mapping):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if choice.get("type", "function") == "function" and isinstance(name, str):
            if name not in names:
                raise InvalidRequestError(
                    f"tool_choice names the function {name!r}, which is not among the tools "
                    f"({', '.join(names)})")
            return "named", name
    raise InvalidRequestError(
        "tool_choice must be 'none', 'auto', 'required' or "
        f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}")
