"""Structured outputs and logit_bias in the engine (tiny random model, real SmolLM2 tokenizer):
outputs match their schema / regex / grammar whatever the weights, free streams beside
constrained ones get exactly their solo tokens, and a constrained stream keeps its grammar
state through eviction to the host tier and through a snapshot moved to another engine."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
from tiny_models import tiny_model_path

from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.structured import from_response_format, json_schema_output
from kvserve.workers.engine.engine import LLMEngine

BS = 4
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "n": {"type": "integer", "minimum": -5, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                 "minItems": 1, "maxItems": 3},
        "where": {"type": "object", "properties": {"x": {"type": "boolean"}},
                  "required": ["x"], "additionalProperties": False},
        "score": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]},
    },
    "required": ["name", "n", "tags", "where", "score"],
    "additionalProperties": False,
}
SPEC = json_schema_output(SCHEMA, strict=True)
# short outputs for the tests that move streams around
SMALL = {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1,
             "maxItems": 2},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["tags", "n"], "additionalProperties": False}
SMALL_SPEC = json_schema_output(SMALL, strict=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return tiny_model_path(tmp_path_factory)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def constrained(seed: int, spec=SPEC, n: int = 80) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=n, structured=spec)


def run_all(eng: LLMEngine) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                got[o.request_id] = o.token_ids
    return got


def text_of(eng: LLMEngine, ids: list[int]) -> str:
    return eng.tokenizer.decode([t for t in ids if t not in eng.tokenizer.eos_token_ids])


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return LLM(tiny, kv_cache_tokens=4096, block_size=BS, host_cache_gib=0)


def test_outputs_match_schema_regex_and_grammar(llm):
    ps = prompts(3, 12, seed=1)
    outs = llm.generate(ps, [constrained(i) for i in range(3)])
    for o in outs:
        assert o.finish_reason == "stop" and o.token_ids[-1] in llm.tokenizer.eos_token_ids
        jsonschema.validate(json.loads(o.text), SCHEMA)
    # any object: random weights need not close it, but what there is opens one (the real
    # model's objects are checked through the served API)
    obj = llm.generate(ps[0], constrained(7, from_response_format({"type": "json_object"}), 8))[0]
    assert obj.text.startswith("{")
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    rx = r"(yes|no) \d{2}-[A-Z]{3}"
    o = llm.generate(ps[1], constrained(8, from_response_format({"type": "regex", "regex": rx})))[0]
    assert re.fullmatch(rx, o.text) and o.finish_reason == "stop"
    gbnf = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "nil"'
    o = llm.generate(ps[2], constrained(9, from_response_format({"type": "grammar",
                                                                  "grammar": gbnf})))[0]
    assert re.fullmatch(r"\((?:[a-c]|nil)(?:,(?:[a-c]|nil))*\)", o.text), o.text
    st = llm.engine.stats()
    assert st["grammar_compiles"] >= 4 and st["grammar_cache_hits"] >= 2  # one compile per spec


def test_free_streams_beside_constrained_get_their_solo_tokens(llm):
    ps = prompts(6, 10, seed=2)
    free = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)]
    solo = [llm.generate(p, sp)[0] for p, sp in zip(ps[:3], free, strict=True)]
    mixed = llm.generate(ps, free + [constrained(i, SMALL_SPEC, 30) for i in range(2)]
                         + [SamplingParams(temperature=0, max_tokens=12, logit_bias={100: 5.0})])
    for s, m in zip(solo, mixed[:3], strict=True):
        assert m.token_ids == s.token_ids
        assert m.logprobs == pytest.approx(s.logprobs, abs=1e-4)  # batched matmul rounding
    for o in mixed[3:5]:
        jsonschema.validate(json.loads(o.text), SMALL)


def test_logit_bias_moves_the_greedy_token(llm):
    p = prompts(1, 10, seed=3)[0]
    base = llm.generate(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    first = base.token_ids[0]
    banned = llm.generate(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                            logit_bias={first: -100}))[0]
    assert banned.token_ids[0] != first
    forced = llm.generate(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                            logit_bias={1234: 100}))[0]
    assert forced.token_ids == [1234] * 4


def test_bad_requests_are_refused(llm):
    p = prompts(1, 5, seed=4)[0]
    bad = [
        ({"structured": json_schema_output({"type": "no-such-type"})}, "no-such-type"),
        ({"structured": from_response_format({"type": "regex", "regex": "(unclosed"})},
         "regular expression"),
        ({"logit_bias": {10**6: 1.0}}, "outside the vocabulary"),
    ]
    for fields, msg in bad:
        with pytest.raises(InvalidRequestError, match=msg):
            llm.engine.add_request(p, SamplingParams(max_tokens=4, **fields))
    for fields, msg in [({"logit_bias": {5: 101.0}}, "between -100 and 100"),
                        ({"structured": SPEC, "ignore_eos": True}, "ignore_eos"),
                        ({"structured": SPEC, "min_tokens": 2}, "min_tokens")]:
        with pytest.raises(InvalidRequestError, match=msg):
            SamplingParams.validated(max_tokens=4, **fields)
    assert not llm.engine.has_unfinished()


def test_constrained_streams_survive_eviction_to_the_host_tier(tiny, llm):
    ps = prompts(3, 24, seed=6)
    params = [constrained(20 + i, SMALL_SPEC, 30) for i in range(3)]
    want = [o.token_ids for o in llm.generate(ps, params)]
    # a pool that holds about two of these streams: the third is parked and restored
    eng = LLM(tiny, kv_cache_tokens=18 * BS, block_size=BS, host_cache_gib=0.001,
              admission_lookahead_tokens=0).engine
    ids = [eng.add_request(p, sp) for p, sp in zip(ps, params, strict=True)]
    got = run_all(eng)
    s = eng.stats()
    assert s["evictions"] > 0 and s["restores"] > 0
    assert [got[i] for i in ids] == want
    for i in ids:
        jsonschema.validate(json.loads(text_of(eng, got[i])), SMALL)
    assert s["grammar_compiles"] == 0  # the process's cache had it from the first engine


@pytest.mark.parametrize("host_gib", [0.001, 0.0])
def test_constrained_stream_moves_to_another_engine(tiny, llm, host_gib):
    p = prompts(1, 20, seed=7)[0]
    params = constrained(31, SMALL_SPEC, 30)
    want = llm.generate(p, params)[0].token_ids
    src = LLM(tiny, kv_cache_tokens=1024, block_size=BS, host_cache_gib=0.001).engine
    rid = src.add_request(p, params, request_id="moving")
    seen: list[int] = []
    while len(seen) < 5:
        for o in src.step():
            seen.extend(o.delta_token_ids)
    assert src.seqs[rid].grammar is not None
    data = src.export_stream(rid)
    dst = LLM(tiny, kv_cache_tokens=1024, block_size=BS, host_cache_gib=host_gib).engine
    assert dst.import_stream(data) == rid
    assert dst.seqs[rid].grammar is not None  # rebuilt from the spec, the output replayed
    out = None
    while dst.has_unfinished():
        for o in dst.step():
            out = o
    assert out is not None and out.token_ids == want and out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), SMALL)
