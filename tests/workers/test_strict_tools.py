"""Strict functions under `tool_choice: "auto"` in the grammar engine: free text until the call
format's marker, then only a call that names a tool with a strict function's arguments valid
against its schema. The matcher is fed token sequences (the real SmolLM2 tokenizer, and a
copy of it where two special tokens are Mistral's `[TOOL_CALLS]` and `[ARGS]`), and a tiny
random model, pushed into a call by logit_bias, writes calls that parse and validate, beside
a free stream, with n > 1 and through a snapshot moved to another engine."""

from __future__ import annotations

import json
import random
import shutil

import jsonschema
import pytest
from tiny_models import tiny_model_path

from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.structured import from_response_format
from kvserve.tools.calls import extract
from kvserve.tools.parsers import HermesParser, Llama3JsonParser, MistralParser, for_template
from kvserve.tools.spec import parse_tools
from kvserve.workers.structured.grammars import check_spec
from kvserve.workers.structured.vocab import marker_tokens

WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"]}}}
NOTE = {"type": "function", "function": {"name": "take_note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
W_ARGS = WEATHER["function"]["parameters"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return tiny_model_path(tmp_path_factory)


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return LLM(tiny, kv_cache_tokens=4096, block_size=4, host_cache_gib=0)


@pytest.fixture(scope="module")
def mistral_like(tiny, tmp_path_factory) -> str:
    """The tiny model, its tokenizer's special tokens 5 and 6 renamed `[TOOL_CALLS]` and
    `[ARGS]`, with a template that renders them (so Mistral's format is picked)."""
    path = tmp_path_factory.mktemp("mistral_like")
    shutil.copytree(tiny, path, dirs_exist_ok=True)
    tj = json.loads((path / "tokenizer.json").read_text())
    names = {5: "[TOOL_CALLS]", 6: "[ARGS]"}
    for t in tj["added_tokens"]:
        if t["id"] in names:
            del tj["model"]["vocab"][t["content"]]
            t["content"] = names[t["id"]]
            tj["model"]["vocab"][t["content"]] = t["id"]
    (path / "tokenizer.json").write_text(json.dumps(tj))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                            "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]"
                            "{% endif %}[TOOL_CALLS]name[ARGS]")
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture(scope="module")
def mllm(mistral_like) -> LLM:
    return LLM(mistral_like, kv_cache_tokens=4096, block_size=4, host_cache_gib=0.001)


def spec_of(parser, tools=(WEATHER, NOTE), parallel=False, answer=None):
    spec = parse_tools(list(tools), "auto", parallel).auto_structured(parser, answer)
    check_spec(spec)  # the ingress's check, without a tokenizer
    return spec


def feed(eng, spec, *pieces, end: bool = True) -> bool:
    """Whether the grammar takes `pieces` (text, tokenized; or token ids), then the end."""
    m = eng.grammars.state(spec).matcher
    for p in pieces:
        ids = [p] if isinstance(p, int) else eng.tokenizer.encode(p, add_special_tokens=False)
        if not all(m.accept_token(t) for t in ids):
            return False
    return bool(m.accept_token(eng.tokenizer.eos_token_ids[0])) if end else True


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def test_hermes_text_is_free_until_the_marker_then_only_valid_calls(llm):
    eng = llm.engine
    one = spec_of(HermesParser())
    assert parse_tools([WEATHER, NOTE], "auto").strict
    assert parse_tools([NOTE], "auto").auto_structured(HermesParser(), None) is None
    assert not parse_tools([WEATHER], "required").strict  # forced calls have their schema
    ok = call("get_weather", '{"city": "Paris", "unit": "C"}')
    assert feed(eng, one, "It is sunny today. {\"json\": true} <b>tags</b> <tool_")
    assert feed(eng, one, "")  # no text at all
    assert feed(eng, one, "Let me check. ", ok)
    assert feed(eng, one, call("get_weather", '{\n  "city": "Rome",\n  "unit": "F"\n}'))
    # non-strict: any object as its arguments; a call still names a tool
    assert feed(eng, one, call("take_note", '{"text": 1, "extra": [null, {"a": "b"}]}'))
    for bad in ['{"city": "Paris", "unit": "C", "extra": 1}',  # a property it does not name
                '{"city": "Paris"}', '{"city": "Paris", "unit": "K"}',
                '{"city": "Paris-and-more", "unit": "C"}', '"{\\"city\\": \\"P\\"}"']:
        assert not feed(eng, one, "Sure. ", call("get_weather", bad), end=False), bad
    assert not feed(eng, one, call("get_time", "{}"), end=False)
    assert not feed(eng, one, '<tool_call>{"name": "get_weather"', end=False)
    # parallel_tool_calls false: the answer ends with its call; true: text and calls go on
    assert not feed(eng, one, ok, " More text", end=False)
    many = spec_of(HermesParser(), parallel=True)
    assert feed(eng, many, ok, " and ", call("take_note", '{"text": "x"}'), " done")


def test_llama3_calls_are_the_whole_message_and_text_is_free_otherwise(llm):
    eng = llm.engine
    spec = spec_of(Llama3JsonParser(), parallel=True)
    ok = '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "C"}}'
    assert feed(eng, spec, "The weather is fine {\"name\": \"x\"} in text.")
    assert feed(eng, spec, ok) and feed(eng, spec, ok + '; {"name": "take_note", "parameters": {"q": 2}}')
    for bad in ['{"name": "get_weather", "parameters": {"city": "Oslo"}}',
                '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}',
                '{"name": "nope", "parameters": {}}', '{"a": 1}', '  {"a": 1}']:
        assert not feed(eng, spec, bad, end=False), bad
    assert not feed(eng, spec, ok, " trailing text", end=False)


def test_mistral_marker_tokens_only_where_the_format_has_them(mllm):
    eng = mllm.engine
    tokens = marker_tokens(eng.tokenizer)
    assert tokens == {"[TOOL_CALLS]": 5, "[ARGS]": 6}
    tc, args = tokens["[TOOL_CALLS]"], tokens["[ARGS]"]
    parser = for_template(eng.tokenizer.chat_template, tokens)
    assert isinstance(parser, MistralParser) and parser.args_format
    listed = spec_of(MistralParser(False, tokens))
    assert feed(eng, listed, "Let me look.")
    assert feed(eng, listed, "Let me look.", tc, ' [{"name": "get_weather", "arguments": '
                '{"city": "Oslo", "unit": "F"}}]')
    assert feed(eng, listed, tc, '[{"name": "take_note", "arguments": {"any": ["thing"]}}]')
    assert not feed(eng, listed, tc, '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
                    end=False)
    assert not feed(eng, listed, tc, '[{"name": "get_weather", "arguments": {"city": "', tc,
                    end=False)  # never inside a string
    # the marker's text in plain tokens (two pieces, so not the special token) starts a call
    assert not feed(eng, listed, "spelled out [TOOL", "_CALLS] and on", end=False)
    assert feed(eng, listed, "spelled out [TOOL", '_CALLS][{"name": "take_note", "arguments": {}}]')
    named = spec_of(MistralParser(True, tokens), parallel=True)
    assert feed(eng, named, "ok", tc, "get_weather", args, '{"city": "Oslo", "unit": "C"}',
                tc, "take_note", args, '{"x": 1}')
    assert not feed(eng, named, tc, "get_weather", args, '{"city": 5}', end=False)
    assert not feed(eng, named, tc, "get_weather", '{"city": "Oslo", "unit": "C"}', end=False)
    # the ingress's parser reads what the grammar lets through
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "unit": "C"}'
    assert extract(text, False, parser)[1][0].name == "get_weather"


def test_response_format_or_calls(llm):
    eng = llm.engine
    rf = from_response_format({"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}})
    spec = spec_of(HermesParser(), answer=rf)
    assert feed(eng, spec, '{"a": 3}')
    assert feed(eng, spec, call("get_weather", '{"city": "Oslo", "unit": "C"}'))
    assert not feed(eng, spec, "free text", end=False)
    assert not feed(eng, spec, '{"a": 3} ', call("get_weather", '{"city": "Oslo", "unit": "C"}'),
                    end=False)
    regex = spec_of(Llama3JsonParser(), answer=from_response_format({"type": "regex",
                                                                     "regex": "(yes|no)!"}))
    assert feed(eng, regex, "yes!") and not feed(eng, regex, "maybe", end=False)


def _mistral_params(seed: int, spec, tc: int, **kw) -> SamplingParams:
    # the bias starts a call at once; the grammar makes it a valid one
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=160, structured=spec,
                          logit_bias={tc: 100.0}, skip_special_tokens=False, **kw)


def test_random_model_pushed_into_a_call_writes_valid_ones(mllm, mistral_like):
    eng = mllm.engine
    tokens = marker_tokens(eng.tokenizer)
    tc = tokens["[TOOL_CALLS]"]
    rng = random.Random(3)
    prompt = [rng.randrange(100, 40000) for _ in range(12)]
    listed, named = MistralParser(False, tokens), MistralParser(True, tokens)
    by_list, by_name = spec_of(listed, tools=(WEATHER,)), spec_of(named, tools=(WEATHER,))
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # both formats in one batch, n = 2 for one (a grammar state each), a free stream beside
    params = [_mistral_params(1, by_list, tc), _mistral_params(1, by_name, tc),
              _mistral_params(2, by_name, tc), free]
    outs = mllm.generate([prompt] * 4, params)
    for o, parser in zip(outs[:3], (listed, named, named), strict=True):
        assert o.token_ids[0] == tc and o.finish_reason == "stop", o.text
        content, calls = extract(o.text, False, parser)
        assert content == "" and len(calls) == 1 and calls[0].name == "get_weather", o.text
        jsonschema.validate(json.loads(calls[0].arguments), W_ARGS)
    assert outs[3].token_ids == mllm.generate(prompt, free)[0].token_ids
    # a stream moved mid-call: the new engine replays its output (the marker too) into a
    # new grammar state and goes on as the stream would have (streams are batch-invariant)
    src = LLM(mistral_like, kv_cache_tokens=1024, block_size=4, host_cache_gib=0.001).engine
    rid = src.add_request(prompt, params[1], request_id="moving")
    seen: list[int] = []
    while len(seen) < 6:
        for o in src.step():
            seen.extend(o.delta_token_ids)
    assert tc in seen
    dst = LLM(mistral_like, kv_cache_tokens=1024, block_size=4, host_cache_gib=0.0).engine
    assert dst.import_stream(src.export_stream(rid)) == rid and dst.seqs[rid].grammar is not None
    out = None
    while dst.has_unfinished():
        for o in dst.step():
            out = o
    assert out is not None and out.token_ids == outs[1].token_ids and out.finish_reason == "stop"


def test_requests_that_cannot_hold_a_grammar_name_the_strict_function():
    spec = spec_of(HermesParser())
    with pytest.raises(InvalidRequestError, match="strict function"):
        SamplingParams.validated(max_tokens=4, structured=spec, ignore_eos=True)
