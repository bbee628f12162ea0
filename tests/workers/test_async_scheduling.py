"""Asynchronous scheduling gives the synchronous engine's outputs (tiny random model, real
tokenizer): greedy and seeded sampling with penalties and logprobs, stop strings, stop ids and
length limits, aborts mid-stream, evictions with and without the host tier, snapshots taken
mid-stream, streams that require synchronous steps, and guided streams (grammar masks,
logit_bias) beside free ones. No stream that finished emits a token
of the step after, and every KV block comes back."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from tiny_models import tiny_model_path

from kvserve import LLM, SamplingParams
from kvserve.structured import json_schema_output
from kvserve.workers.engine.engine import LLMEngine

BS = 4


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return tiny_model_path(tmp_path_factory)


def engine(path: str, overlap: bool, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_tokens", 4096)
    kw.setdefault("host_cache_gib", 0)
    # float32 everywhere: on a GPU host this runs the CUDA path (graphs, ids on the device)
    return LLM(path, block_size=BS, async_scheduling=overlap, dtype="float32", **kw).engine


def prompts(n: int, seed: int, lo: int = 5, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def drive(eng: LLMEngine, reqs: list[tuple[list[int], SamplingParams]], on_step=None) -> dict[str, dict]:
    """Run to completion; per request its final output and what its streamed outputs added up
    to (they must agree: a stream never shows a token after its end)."""
    ids = [eng.add_request(p, sp, request_id=f"r{i}") for i, (p, sp) in enumerate(reqs)]
    streamed: dict[str, list[int]] = {i: [] for i in ids}
    text: dict[str, str] = {i: "" for i in ids}
    final: dict[str, dict] = {}
    n = 0
    while eng.has_unfinished():
        for o in eng.step():
            assert o.request_id not in final, "an output after the request finished"
            streamed[o.request_id] += o.delta_token_ids
            text[o.request_id] += o.delta_text
            if o.finished:
                final[o.request_id] = {"ids": o.token_ids, "text": o.text, "reason": o.finish_reason,
                                       "stop": o.stop_reason, "lp": o.logprobs, "top": o.top_logprobs}
        eng.check_invariants()
        n += 1
        if on_step is not None:
            on_step(eng, n, streamed)
    for rid, f in final.items():
        if f["reason"] != "abort":
            assert streamed[rid] == f["ids"] and text[rid] == f["text"], rid
    assert eng.kv.streams == {} and eng.kv.held == {} and eng.kv.pool.num_used == 0
    assert eng.kv.host is None or eng.kv.host.num_used == 0
    return final


def both(path: str, reqs, **kw) -> tuple[dict, dict]:
    return drive(engine(path, False, **kw), reqs), drive(engine(path, True, **kw), reqs)


def test_greedy_with_length_stop_ids_and_stop_strings(path):
    ps = prompts(12, seed=1)
    plain = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(12)]
    ref = drive(engine(path, False), list(zip(ps, plain, strict=True)))
    # stop ids and stop strings taken from the reference outputs, so they do fire mid-stream
    params = []
    for i in range(12):
        out = ref[f"r{i}"]
        if i % 3 == 0 and len(out["ids"]) > 3:
            sp = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[out["ids"][3]])
        elif i % 3 == 1 and len(out["text"]) > 6:
            sp = SamplingParams(temperature=0, max_tokens=40, stop=[out["text"][4:6]])
        else:
            sp = SamplingParams(temperature=0, max_tokens=1 + i)
        params.append(sp)
    reqs = list(zip(ps, params, strict=True))
    sync, over = both(path, reqs)
    assert sync == over
    assert {f["reason"] for f in sync.values()} >= {"stop", "length"}
    assert any(isinstance(f["stop"], str) for f in sync.values())
    assert any(isinstance(f["stop"], int) for f in sync.values())


def test_seeded_sampling_penalties_and_logprobs(path):
    ps = prompts(10, seed=2)
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=100 + i, max_tokens=12,
                             repetition_penalty=1.3 if i % 2 else 1.0,
                             frequency_penalty=0.5 if i % 3 == 0 else 0.0,
                             presence_penalty=0.4 if i % 4 == 0 else 0.0,
                             min_tokens=4 if i % 5 == 0 else 0,
                             logprobs=2 if i % 2 == 0 else None, ignore_eos=i % 2 == 0)
              for i in range(10)]
    sync, over = both(path, list(zip(ps, params, strict=True)))
    assert sync == over
    assert all(len(f["ids"]) >= 4 for f in sync.values())


def test_evictions_with_and_without_host_tier(path):
    ps = prompts(10, seed=3, lo=10, hi=40)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reqs = [(p, sp) for p in ps]
    ref = drive(engine(path, False), reqs)
    for host in (0, 0.002):
        kw = {"kv_cache_tokens": 40 * BS, "host_cache_gib": host, "admission_lookahead_tokens": 0}
        sync_eng, over_eng = engine(path, False, **kw), engine(path, True, **kw)
        sync, over = drive(sync_eng, reqs), drive(over_eng, reqs)
        assert sync == over == ref
        assert over_eng.stats()["evictions"] > 0


def test_abort_mid_stream(path):
    ps = prompts(6, seed=4)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reqs = [(p, sp) for p in ps]

    def abort_r2(eng, n, streamed):
        if len(streamed["r2"]) >= 5 and "r2" in eng.seqs:
            assert eng.abort("r2")

    results = []
    for overlap in (False, True):
        eng = engine(path, overlap)
        final = drive(eng, reqs, abort_r2)
        results.append(final)
        assert "r2" not in final  # an aborted request has no final output from step()
    assert results[0] == results[1]
    assert len(results[0]) == 5


def test_snapshot_mid_stream_resumes_elsewhere(path):
    ps = prompts(4, seed=5)
    params = [SamplingParams(temperature=0.8, seed=7 + i, max_tokens=16, ignore_eos=True) for i in range(4)]
    reqs = list(zip(ps, params, strict=True))
    ref = drive(engine(path, False), reqs)
    for target_overlap in (False, True):
        src = engine(path, True, host_cache_gib=0.002)
        dst = engine(path, target_overlap, host_cache_gib=0.002)
        for i, (p, sp) in enumerate(reqs):
            src.add_request(p, sp, request_id=f"r{i}")
        got: dict[str, list[int]] = {}
        for _ in range(5):
            for o in src.step():
                got[o.request_id] = got.get(o.request_id, []) + o.delta_token_ids
        snap = src.export_stream("r1")  # its last sampled token travels with it
        dst.import_stream(snap)
        while src.has_unfinished():
            for o in src.step():
                got[o.request_id] = got.get(o.request_id, []) + o.delta_token_ids
        while dst.has_unfinished():
            for o in dst.step():
                got[o.request_id] = got.get(o.request_id, []) + o.delta_token_ids
        assert {k: v for k, v in got.items()} == {k: f["ids"] for k, f in ref.items()}
        for eng in (src, dst):
            eng.check_invariants()
            assert eng.kv.pool.num_used == 0 and eng.kv.host.num_used == 0


def test_stream_that_requires_sync_steps(path):
    ps = prompts(4, seed=6)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    reqs = [(p, sp) for p in ps]
    ref = drive(engine(path, False), reqs)
    eng = engine(path, True)
    schedule = eng.scheduler.schedule
    overlapped = []

    def checked():
        plan, seqs = schedule()
        for s in seqs:
            if s.requires_sync:
                overlapped.append(s.inflight_row >= 0)
        return plan, seqs

    eng.scheduler.schedule = checked
    add = eng.add_sequence

    def add_sync(seq):
        seq.requires_sync = seq.request_id == "r1"
        add(seq)

    eng.add_sequence = add_sync
    assert drive(eng, reqs) == ref
    assert overlapped and not any(overlapped)  # never planned with its token in flight


SCHEMA = {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1,
             "maxItems": 2},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["tags", "n"], "additionalProperties": False}


def test_guided_streams_beside_free_ones(path):
    """A grammar's mask is built from every token before it, also while the stream's last
    token is still on the device: guided streams (seeded JSON, logit_bias) give the same
    tokens with the overlap on and off, and do run overlapped."""
    ps = prompts(6, seed=9)
    spec = json_schema_output(SCHEMA, strict=True)
    params = [
        SamplingParams(temperature=1.0, seed=1, max_tokens=60, structured=spec),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=2, max_tokens=60, structured=spec,
                       presence_penalty=0.5),
        SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True,
                       logit_bias={ps[0][0]: 5.0, 1000: -100.0}),
        SamplingParams(temperature=1.0, seed=4, max_tokens=60, structured=spec, logprobs=2),
        SamplingParams(temperature=1.0, seed=5, max_tokens=12),
    ]
    reqs = list(zip(ps, params, strict=True))
    ref = drive(engine(path, False), reqs)
    eng = engine(path, True)
    schedule = eng.scheduler.schedule
    overlapped = []

    def checked():
        plan, seqs = schedule()
        overlapped.extend(s.grammar is not None and s.inflight_row >= 0 for s in seqs)
        return plan, seqs

    eng.scheduler.schedule = checked
    got = drive(eng, reqs)
    assert got == ref
    assert any(overlapped)  # guided streams were planned with their last token in flight
    for i in (0, 2, 4):
        out = got[f"r{i}"]
        assert out["reason"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert 1000 not in got["r3"]["ids"]


def test_llm_generate_is_the_same(path):
    ps = prompts(8, seed=8)
    sp = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    a = LLM(path, block_size=BS, kv_cache_tokens=2048, async_scheduling=False,
            dtype="float32").generate(ps, sp)
    llm = LLM(path, block_size=BS, kv_cache_tokens=2048, async_scheduling=True, dtype="float32")
    b = llm.generate(ps, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.text for o in a] == [o.text for o in b]
    assert not llm.engine.has_unfinished() and llm.engine.kv.pool.num_used == 0
