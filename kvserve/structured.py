"""Structured outputs: what a request's output must match, as one small value.

`StructuredOutput` travels inside `SamplingParams` (so a stream's snapshot carries it and a
moved stream rebuilds its grammar), and each worker's grammar engine compiles it
(`kvserve.workers.structured`). The front ends turn their own request shapes into it:
OpenAI's `response_format` (`from_response_format`), kvserve's `regex` / `grammar`
extensions, forced tool calls and the calls of strict functions under `tool_choice: "auto"`
(`kvserve.tools`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from kvserve.errors import InvalidRequestError

Kind = Literal["json_object", "json_schema", "regex", "grammar", "structural_tag"]

# A schema nested deeper than this is refused before any engine sees it (a hostile schema
# must not cost the ingress a deep recursion).
MAX_SCHEMA_DEPTH = 64
MAX_SPEC_CHARS = 256 * 1024


class StructuredOutput(BaseModel):
    """The constraint on one request's output.

    - `json_object`: any JSON object.
    - `json_schema`: JSON matching `spec` (the schema as compact JSON text); `strict` keeps
      it to exactly the schema (no properties it does not name, as OpenAI's strict mode).
    - `regex`: text matching the regular expression `spec`.
    - `grammar`: text of the grammar `spec`, in GBNF (llama.cpp's grammar syntax; the
      start rule is `root`).
    - `structural_tag`: the grammar engine's structural tag `spec` (xgrammar's JSON form):
      free text until a trigger string, then a constrained part (a strict function's call
      under `tool_choice: "auto"`; built by `kvserve.tools`, not taken from clients).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Kind
    spec: str = ""
    strict: bool = False

    @model_validator(mode="after")
    def _check(self) -> StructuredOutput:
        if self.type != "json_object" and not self.spec:
            raise ValueError(f"a {self.type} constraint needs its {_WHAT[self.type]}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"the {_WHAT[self.type]} has {len(self.spec)} characters; "
                             f"at most {MAX_SPEC_CHARS} are accepted")
        return self

    def key(self) -> str:
        """The cache key of its compiled form (with the tokenizer's)."""
        return f"{self.type}\x00{int(self.strict)}\x00{self.spec}"


_WHAT = {"json_object": "", "json_schema": "schema", "regex": "regular expression",
         "grammar": "grammar", "structural_tag": "structural tag"}


def json_schema_output(schema: Any, strict: bool = False, where: str = "schema") -> StructuredOutput:
    """A json_schema constraint from a schema object (or its JSON text)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{where} is not valid JSON: {e}") from None
    if isinstance(schema, bool):  # `true` accepts any value, `false` none: both legal schemas
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, Mapping):
        raise InvalidRequestError(f"{where} must be a JSON object, got {type(schema).__name__}")
    _check_depth(schema, where)
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    return _built(type="json_schema", spec=text, strict=strict)


def structural_tag_output(fmt: Mapping[str, Any], where: str = "tools") -> StructuredOutput:
    """A structural_tag constraint from a format (xgrammar's structural tag `format` object)."""
    _check_depth(fmt, where)
    text = json.dumps({"type": "structural_tag", "format": fmt}, separators=(",", ":"),
                      ensure_ascii=False)
    return _built(type="structural_tag", spec=text)


def as_format(s: StructuredOutput) -> dict[str, Any]:
    """`s` as a structural tag format, to be one part of a larger structure.

    A JSON schema there is always kept to exactly the schema (as `strict`), which a non-strict
    schema's valid outputs include."""
    if s.type == "json_object":
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if s.type == "json_schema":
        return {"type": "json_schema", "json_schema": json.loads(s.spec)}
    if s.type == "regex":
        return {"type": "regex", "pattern": s.spec}
    if s.type == "grammar":
        return {"type": "grammar", "grammar": s.spec}
    return json.loads(s.spec)["format"]


def from_response_format(rf: Any) -> StructuredOutput | None:
    """OpenAI's `response_format` (a dict) -> the constraint, None for plain text.

    `{"type": "text"}`, `{"type": "json_object"}`,
    `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": bool}}`;
    kvserve adds `{"type": "regex", "regex": "..."}` and `{"type": "grammar", "grammar": "..."}`
    (GBNF).
    """
    if rf is None:
        return None
    if not isinstance(rf, Mapping):
        raise InvalidRequestError(f"response_format must be an object, got {type(rf).__name__}")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _built(type="json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, Mapping):
            raise InvalidRequestError("response_format.json_schema must be an object with "
                                      "'name' and 'schema'")
        name = js.get("name")
        if name is not None and not isinstance(name, str):
            raise InvalidRequestError("response_format.json_schema.name must be a string")
        if "schema" not in js:
            raise InvalidRequestError("response_format.json_schema.schema is missing")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequestError("response_format.json_schema.strict must be a boolean")
        return json_schema_output(js["schema"], bool(strict), "response_format.json_schema.schema")
    if kind == "regex":
        return _built(type="regex", spec=_text(rf, "regex"))
    if kind == "grammar":
        syntax = rf.get("syntax", "gbnf")
        if syntax != "gbnf":
            raise InvalidRequestError(
                f"response_format.syntax {syntax!r} is not supported; grammars are GBNF")
        return _built(type="grammar", spec=_text(rf, "grammar"))
    raise InvalidRequestError(
        f"response_format.type {kind!r} is not supported; use 'text', 'json_object', "
        "'json_schema', or kvserve's 'regex' and 'grammar'")


def _text(rf: Mapping[str, Any], field: str) -> str:
    v = rf.get(field)
    if not isinstance(v, str) or not v:
        raise InvalidRequestError(f"response_format.{field} must be a non-empty string")
    return v


def _built(**fields: Any) -> StructuredOutput:
    try:
        return StructuredOutput(**fields)
    except ValueError as e:
        msg = str(e).splitlines()
        raise InvalidRequestError(msg[-1].removeprefix("  Value error, ") if msg else str(e)) \
            from None


def _check_depth(value: Any, where: str) -> None:
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidRequestError(f"{where} nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(v, Mapping):
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)
