"""Structured outputs, tool calls and logit_bias end to end: the openai SDK and the gRPC stubs
against the session's served app (SmolLM2-135M, real Ray and Serve)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Literal

import grpc
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from kvserve.protos import kvserve_pb2 as pb
from kvserve.protos import kvserve_pb2_grpc

# nested objects, arrays with bounds, enums, integer ranges, anyOf; strings kept short so a
# temperature-1 answer ends within max_tokens
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "country": {"enum": ["France", "Spain", "Italy", "Japan"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 50000000},
        "landmarks": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 16},
                           "year": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 2100},
                                              {"type": "null"}]}},
            "required": ["name", "year"], "additionalProperties": False}},
    },
    "required": ["city", "country", "population", "landmarks"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 12}},
                   "required": ["tz"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
PARAMS = {f["function"]["name"]: f["function"]["parameters"] for f in (WEATHER, TIME)}
STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
# SmolLM2 answers this with "<tool_response>" (greedy): banning "response" makes it "<tool_call>"
CALL_ME = [{"role": "user", "content": "Use a tool call: get_weather for Paris in celsius."}]


class Landmark(BaseModel):
    name: str = Field(max_length=16)
    year: int | None = Field(ge=0, le=2100)


class City(BaseModel):
    city: str = Field(max_length=16)
    country: Literal["France", "Spain", "Italy", "Japan"]
    landmarks: list[Landmark] = Field(min_length=1, max_length=2)


@pytest.fixture(scope="module")
def client(serve_app):
    return openai.OpenAI(base_url=serve_app.http_url + "/v1", api_key=serve_app.api_key,
                         max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def stub(serve_app):
    with grpc.insecure_channel(serve_app.grpc_target) as ch:
        yield kvserve_pb2_grpc.KVServeStub(ch)


def test_json_schema_choices_at_temperature_1_validate(client):
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Describe a famous city."}],
        temperature=1.0, seed=3, n=3, max_tokens=120,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": CITY, "strict": True}})
    assert len(r.choices) == 3
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), CITY)
    # completions take it too; json_object gives an object
    c = client.completions.create(model="default", prompt="A city, as JSON:", max_tokens=60,
                                  temperature=0, extra_body={"response_format": {"type": "json_object"}})
    assert c.choices[0].finish_reason == "stop" and isinstance(json.loads(c.choices[0].text), dict)


def test_beta_parse_returns_the_pydantic_object(client):
    r = client.beta.chat.completions.parse(
        model="default", messages=[{"role": "user", "content": "Tell me about Rome."}],
        response_format=City, temperature=0, max_tokens=100)
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.country in ("France", "Spain", "Italy", "Japan")
    assert 1 <= len(city.landmarks) <= 2


def _tool_call_streamed(client, **kw) -> tuple[list[tuple[str, str]], str]:
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or ():
                if d.id is not None:  # a call's first delta names it
                    assert d.type == "function" and d.function.name and d.index not in calls
                    calls[d.index] = [d.function.name, ""]
                calls[d.index][1] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    return [(n, a) for _, (n, a) in sorted(calls.items())], finish


@pytest.mark.parametrize("choice", [
    "required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_validate_and_stream_as_they_answer(client, choice):
    kw = dict(model="default", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
              temperature=0, max_tokens=80, parallel_tool_calls=False)
    r = client.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in ch.message.tool_calls]
    assert len(calls) == 1 and ch.message.tool_calls[0].id.startswith("call_")
    if isinstance(choice, dict):
        assert calls[0][0] == "get_time"
    for name, args in calls:
        jsonschema.validate(json.loads(args), PARAMS[name])
    streamed, finish = _tool_call_streamed(client, **kw)
    assert streamed == calls and finish == "tool_calls"


def test_tool_results_go_back_into_the_conversation(client):
    msgs = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    r = client.chat.completions.create(model="default", messages=msgs, tools=[WEATHER],
                                       temperature=0, max_tokens=24)
    ch = r.choices[0]
    assert ch.finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 100  # the tools prompt, the call and its result are in it
    # tool_choice none: the tools are shown but no call comes back
    r = client.chat.completions.create(model="default", messages=ASK, tools=[WEATHER],
                                       tool_choice="none", temperature=0, max_tokens=16)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


@pytest.fixture(scope="module")
def no_response() -> dict[str, float]:
    from kvserve.models import default_model
    from kvserve.workers.loading.tokenizer import load_tokenizer

    ids = load_tokenizer(default_model()).encode("<tool_response>", add_special_tokens=False)
    return {ids[3]: -100.0}  # "<", "tool", "_", "response", ">"


def test_strict_function_under_auto_calls_validate_and_text_stays_free(client, no_response):
    kw = dict(model="default", messages=CALL_ME, tools=[STRICT_WEATHER, TIME], temperature=0,
              max_tokens=48, parallel_tool_calls=False,
              logit_bias={str(k): v for k, v in no_response.items()})
    ch = client.chat.completions.create(**kw).choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch.message
    call = ch.message.tool_calls[0].function
    jsonschema.validate(json.loads(call.arguments), PARAMS[call.name])
    streamed, finish = _tool_call_streamed(client, **kw)
    assert streamed == [(call.name, call.arguments)] and finish == "tool_calls"
    # no call: the answer is text, as without strict
    r = client.chat.completions.create(model="default", messages=ASK, tools=[STRICT_WEATHER],
                                       temperature=0, max_tokens=12)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None
    # with a response_format: an answer in that format, or a call
    yes_no = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="default", messages=ASK, tools=[STRICT_WEATHER], temperature=0, max_tokens=64,
        parallel_tool_calls=False,
        response_format={"type": "json_schema", "json_schema": {"name": "yn", "schema": yes_no}})
    m = r.choices[0].message
    assert r.choices[0].finish_reason in ("stop", "tool_calls"), m
    if m.tool_calls:
        jsonschema.validate(json.loads(m.tool_calls[0].function.arguments), PARAMS["get_weather"])
    else:
        jsonschema.validate(json.loads(m.content), yes_no)


def test_logit_bias_changes_the_greedy_token(serve_app, client, stub):
    md = serve_app.metadata
    base = stub.Generate(pb.GenerateRequest(prompt="The capital of France is", sampling=pb.SamplingParams(
        temperature=0, max_tokens=3)), metadata=md)
    first = base.token_ids[0]
    biased = stub.Generate(pb.GenerateRequest(prompt="The capital of France is", sampling=pb.SamplingParams(
        temperature=0, max_tokens=3, logit_bias={first: -100})), metadata=md)
    assert biased.token_ids[0] != first
    c = client.completions.create(model="default", prompt="The capital of France is", max_tokens=3,
                                  temperature=0, logit_bias={str(first): -100})
    assert c.choices[0].text == biased.text


@pytest.mark.parametrize("extra,msg", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}}, "no-such-type"),
    ({"response_format": {"type": "regex", "regex": "([a-z"}}, "regular expression"),
    ({"response_format": {"type": "yaml"}}, "yaml"),
    ({"logit_bias": {"99999999": 1}}, "outside the vocabulary"),
    ({"logit_bias": {"5": 250}}, "between -100 and 100"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "forced tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "nope"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens"),
    ({"tools": [STRICT_WEATHER], "ignore_eos": True}, "strict function"),
])
def test_bad_requests_get_400_naming_the_problem(client, extra, msg):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=ASK, max_tokens=4,
                                       extra_body=extra)
    assert msg in str(e.value)


def test_unknown_fields_are_ignored(client):
    r = client.chat.completions.create(model="default", messages=ASK, max_tokens=2, user="u1",
                                       extra_body={"some_future_field": {"x": 1}})
    assert r.choices[0].finish_reason == "length"


def test_grpc_structured_outputs_tools_and_errors(serve_app, stub, no_response):
    md = serve_app.metadata
    fmt = pb.ResponseFormat(json_schema=pb.JsonSchema(name="city", schema=json.dumps(CITY),
                                                      strict=True))
    r = stub.Chat(pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="A famous city?")],
                                 sampling=pb.SamplingParams(temperature=1.0, seed=5, max_tokens=120,
                                                            response_format=fmt)), metadata=md)
    assert r.finish_reason == "stop"
    jsonschema.validate(json.loads(r.text), CITY)

    def tool(t):
        f = t["function"]
        return pb.Tool(function=pb.FunctionDefinition(name=f["name"], description=f["description"],
                                                      parameters=json.dumps(f["parameters"])))

    req = pb.ChatRequest(messages=[pb.ChatMessage(**ASK[0])], tools=[tool(WEATHER), tool(TIME)],
                         tool_choice=pb.ToolChoice(function_name="get_weather"),
                         sampling=pb.SamplingParams(temperature=0, max_tokens=80))
    r = stub.Chat(req, metadata=md)
    assert r.finish_reason == "tool_calls" and len(r.tool_calls) == 1 and r.text == ""
    call = r.tool_calls[0]
    assert call.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), PARAMS["get_weather"])
    chunks = list(stub.ChatStream(req, metadata=md))
    deltas = [d for c in chunks for d in c.tool_calls]
    assert deltas[0].id and deltas[0].name == "get_weather"
    assert "".join(d.arguments for d in deltas) == call.arguments
    assert chunks[-1].finish_reason == "tool_calls"

    # a strict function under auto: the call it starts follows its schema
    strict = tool(STRICT_WEATHER)
    strict.function.strict = True
    r = stub.Chat(pb.ChatRequest(messages=[pb.ChatMessage(**CALL_ME[0])], tools=[strict],
                                 parallel_tool_calls=False, sampling=pb.SamplingParams(temperature=0, max_tokens=48,
                                                            logit_bias=no_response)), metadata=md)
    assert r.finish_reason == "tool_calls" and len(r.tool_calls) == 1, r.text
    assert r.tool_calls[0].name == "get_weather"
    jsonschema.validate(json.loads(r.tool_calls[0].arguments), PARAMS["get_weather"])

    bad = pb.ResponseFormat(json_schema=pb.JsonSchema(schema='{"type": "no-such-type"}'))
    for sampling, msg in [(pb.SamplingParams(response_format=bad), "no-such-type"),
                          (pb.SamplingParams(logit_bias={5: 101.0}), "between -100 and 100"),
                          (pb.SamplingParams(response_format=pb.ResponseFormat(regex="(")),
                           "regular expression")]:
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(pb.GenerateRequest(prompt="hi", sampling=sampling), metadata=md)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and msg in e.value.details()


def test_reflection_describes_the_new_messages(serve_app):
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(serve_app.grpc_target) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvserve.v1.KVServe")
        resp = next(iter(stub.ServerReflectionInfo(iter([req]), timeout=30)))
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in resp.file_descriptor_response.file_descriptor_proto]
    messages = {m.name: m for f in files for m in f.message_type}
    assert {"ResponseFormat", "JsonSchema", "Tool", "ToolChoice", "ToolCall",
            "ToolCallDelta"} <= set(messages)
    fields = {f.name for f in messages["SamplingParams"].field}
    assert {"logit_bias", "response_format"} <= fields
    assert "tool_calls" in {f.name for f in messages["GenerateStreamResponse"].field}


def test_cli_generate_json_schema_from_a_file(serve_app, tmp_path):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                               "score": {"type": "integer", "minimum": 1,
                                                         "maximum": 5}},
              "required": ["answer", "score"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    out = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "generate", "--server", serve_app.grpc_target,
         "--api-key", serve_app.api_key, "--prompt", "Is the sky blue? Answer in JSON:",
         "--max-tokens", "30", "--json-schema", str(path)],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    jsonschema.validate(json.loads(out.stdout), schema)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    out = subprocess.run([sys.executable, "-m", "kvserve.cli", "generate", "--server",
                          serve_app.grpc_target, "--prompt", "x", "--json-schema", str(bad)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "not valid JSON" in out.stderr
