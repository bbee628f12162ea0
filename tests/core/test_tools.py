"""Tool calls without a model: request checks, the forced-call schema, the parsers of each
family's call format, streamed deltas against the whole answer, and the tools prompt."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvserve.errors import InvalidRequestError
from kvserve.structured import from_response_format
from kvserve.tools import prompt
from kvserve.tools.calls import ToolStream, extract
from kvserve.tools.parsers import HermesParser, Llama3JsonParser, MistralParser, for_template
from kvserve.tools.spec import parse_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}


def test_tool_choice_modes_and_errors():
    assert parse_tools(None) is None and parse_tools([], "auto") is None
    assert parse_tools([WEATHER]).mode == "auto"
    plan = parse_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert plan.mode == "named" and plan.name == "get_time" and plan.forced
    assert parse_tools([WEATHER], "none").returns_calls is False
    bad = [
        (([WEATHER], {"type": "function", "function": {"name": "nope"}}), "not among the tools"),
        (([WEATHER], "sometimes"), "tool_choice must be"),
        ((None, "required"), "tool_choice needs tools"),
        (([WEATHER, WEATHER], None), "given twice"),
        (([{"type": "retrieval"}], None), "only 'function' tools"),
        (([{"type": "function", "function": {"name": "a b"}}], None), "function.name"),
        (([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
          None), "describe an object"),
    ]
    for (tools, choice), msg in bad:
        with pytest.raises(InvalidRequestError, match=msg):
            parse_tools(tools, choice)


def test_forced_schema_accepts_calls_and_refuses_others():
    req = json.loads(parse_tools([WEATHER, TIME], "required").structured().spec)
    one = json.loads(parse_tools([WEATHER, TIME], "required", False).structured().spec)
    named = json.loads(parse_tools([WEATHER, TIME], {"type": "function",
                                                     "function": {"name": "get_time"}}).structured().spec)
    w = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}
    t = {"name": "get_time", "arguments": {"tz": "UTC"}}
    jsonschema.validate([w, t], req)
    jsonschema.validate([t], named)
    for inst, schema in [([], req), ([w, t], one), ([w], named),
                         ([{"name": "get_weather", "arguments": {"city": "Paris"}}], req),
                         ([{"name": "other", "arguments": {}}], req)]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(inst, schema)


FORCED = ('[{"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\"", "unit": "C"}}, '
          '{"name": "get_time", "arguments": {"tz": "UTC"}}]')


@pytest.mark.parametrize("cut", [1, 2, 3, 7, 1000])
def test_forced_calls_streamed_in_pieces_join_to_the_whole(cut):
    content, calls = extract(FORCED, True, HermesParser())
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": 'Paris, "FR"', "unit": "C"}), ("get_time", {"tz": "UTC"})]
    ts = ToolStream(True, HermesParser())
    deltas = []
    for i in range(0, len(FORCED), cut):
        text, ds = ts.feed(FORCED[i : i + cut])
        assert text == ""
        deltas += ds
    deltas += ts.finish()[1]
    firsts = [d for d in deltas if d.id is not None]
    assert [d.name for d in firsts] == ["get_weather", "get_time"] and [d.index for d in firsts] == [0, 1]
    for i, call in enumerate(calls):
        mine = [d for d in deltas if d.index == i]
        assert mine[0].id is not None  # the first delta of a call names it
        assert "".join(d.arguments for d in mine) == call.arguments


def test_forced_call_cut_off_by_length_keeps_its_partial_arguments():
    text = '[{"name": "get_time", "arguments": {"tz": "Eur'
    ts = ToolStream(True, HermesParser())
    streamed = ts.feed(text)[1] + ts.finish()[1]
    _, calls = extract(text, True, HermesParser())
    assert calls[0].arguments == '{"tz": "Eur'
    assert "".join(d.arguments for d in streamed) == calls[0].arguments


@pytest.mark.parametrize("parser,text,content", [
    (HermesParser(), 'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n'
                     '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": '
                     '{"city": "Oslo", "unit": "C"}}</tool_call>', "Sure.\n\n"),
    (Llama3JsonParser(), '<|python_tag|>{"name": "get_time", "parameters": {"tz": "UTC"}}; '
                         '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}}', ""),
    (MistralParser(), 'Let me check.[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "UTC"}},'
                      ' {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}]',
     "Let me check."),
    (MistralParser(), '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}[TOOL_CALLS]get_weather[ARGS]'
                      '{"city": "Oslo", "unit": "C"}', ""),
])
def test_each_family_format_parses_whole_and_streamed(parser, text, content):
    got_content, calls = extract(text, False, parser)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"tz": "UTC"}), ("get_weather", {"city": "Oslo", "unit": "C"})]
    ts = ToolStream(False, parser)
    sent, deltas = "", []
    for i in range(0, len(text), 3):
        c, d = ts.feed(text[i : i + 3])
        sent, deltas = sent + c, deltas + d
    c, d = ts.finish()
    sent, deltas = sent + c, deltas + d
    assert sent == content
    assert [(d.name, d.arguments) for d in deltas] == [(c.name, c.arguments) for c in calls]


def test_plain_text_and_broken_calls_stay_content():
    for parser in (HermesParser(), Llama3JsonParser(), MistralParser()):
        for text in ["Paris is the capital.", "<tool_call>{not json</tool_call>", "{\"a\": 1}",
                     "[TOOL_CALLS]oops"]:
            content, calls = extract(text, False, parser)
            assert calls == [] and content == text
    # a marker's first characters are held only until they turn out to be text
    ts = ToolStream(False, HermesParser())
    assert ts.feed("a <tool")[0] == "a " and ts.feed("s> b")[0] == "<tools> b"


def test_parser_follows_the_template():
    assert isinstance(for_template(None), HermesParser)
    assert isinstance(for_template("{{ '<tool_call>' }} tools"), HermesParser)
    assert isinstance(for_template("[TOOL_CALLS] {{ tools }}"), MistralParser)
    assert isinstance(for_template("<|start_header_id|>{% if tools %}"), Llama3JsonParser)


def test_default_tools_prompt_and_tool_messages():
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "4 C"}]
    out = prompt.plain(msgs, [WEATHER])
    assert out[0]["content"].startswith("Be brief.\n\n") and '"get_weather"' in out[0]["content"]
    assert "<tool_call>" in out[2]["content"] and '"city": "Oslo"' in out[2]["content"]
    assert out[3] == {"role": "user", "content": "<tool_response>\n4 C\n</tool_response>"}
    fixed = prompt.for_template(msgs)
    assert fixed[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo", "unit": "C"}
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        prompt.plain([{"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "{oops"}}]}], None)


def test_response_format_shapes():
    assert from_response_format(None) is None and from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}).type == "json_object"
    s = from_response_format({"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": True}})
    assert s.type == "json_schema" and s.strict and json.loads(s.spec) == {"type": "object"}
    assert from_response_format({"type": "regex", "regex": "[0-9]+"}).spec == "[0-9]+"
    for rf, msg in [({"type": "yaml"}, "not supported"), ({"type": "json_schema"}, "json_schema"),
                    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema is missing"),
                    ({"type": "json_schema", "json_schema": {"schema": 3}}, "JSON object"),
                    ({"type": "regex"}, "non-empty string"),
                    ({"type": "grammar", "grammar": "root ::= x", "syntax": "lark"}, "GBNF")]:
        with pytest.raises(InvalidRequestError, match=msg):
            from_response_format(rf)


def test_smollm2_template_gets_the_default_tools_prompt():
    from kvserve.models import default_model
    from kvserve.workers.loading.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model())
    msgs = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "4 C"}]
    text = tok.apply_chat_template(msgs, tools=[WEATHER])
    assert text.startswith("<|im_start|>system\n") and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\n4 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = tok.apply_chat_template(msgs[:1])
    assert "<tools>" not in plain  # no tools, no tools prompt


def test_forced_arguments_name_only_the_parameters():
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from kvserve.workers.structured.grammars import _grammar, _xgr

    loose = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
    open_ = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"],
        "additionalProperties": True}}}
    call = '[{"name": "get_time", "arguments": {"tz": "UTC"%s}}]'
    for tool, extra_ok in [(loose, False), (open_, True)]:
        g = _grammar(_xgr(), parse_tools([tool], "required").structured())
        assert accepts(g, call % "")
        assert accepts(g, call % ', "id": 1') is extra_ok
