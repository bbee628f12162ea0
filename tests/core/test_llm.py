"""The offline API on the default model: generate, chat, stop conditions, errors, KV hygiene."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.errors import ConfigError, InvalidRequestError

GREEDY = SamplingParams(temperature=0, max_tokens=24)


def assert_idle(llm: LLM) -> None:
    eng = llm.engine
    assert not eng.has_unfinished()
    assert eng.kv.streams == {}
    assert eng.kv.pool.num_used == 0
    eng.kv.check_invariants()


def test_generate_strings_and_ids(smol_llm: LLM):
    tok = smol_llm.tokenizer
    prompts = ["The capital of France is", tok.encode("Water boils at")]
    outs = smol_llm.generate(prompts, GREEDY)
    assert [o.prompt_token_ids for o in outs] == [tok.encode(prompts[0]), prompts[1]]
    for o in outs:
        assert o.finish_reason in ("stop", "length")
        assert 0 < len(o.token_ids) <= 24
        assert o.text == tok.decode(o.token_ids) or o.finish_reason == "stop"
        assert o.usage.completion_tokens == len(o.token_ids)
    assert "Paris" in outs[0].text
    assert_idle(smol_llm)


def test_chat_uses_template(smol_llm: LLM):
    (out,) = smol_llm.chat([{"role": "user", "content": "How many days are in a week?"}],
                           SamplingParams(temperature=0, max_tokens=40))
    assert "7 days" in out.text
    assert out.finish_reason == "stop"  # the model ends its turn with EOS (<|im_end|>)
    assert_idle(smol_llm)


def test_stop_strings(smol_llm: LLM):
    base = smol_llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=20))[0]
    assert " 5" in base.text, base.text
    cut = base.text.index(" 5")
    out = smol_llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=20, stop=[" 5"]))[0]
    assert out.text == base.text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == " 5"
    inc = smol_llm.generate(
        "Count: 1, 2, 3,",
        SamplingParams(temperature=0, max_tokens=20, stop=[" 5"], include_stop_str_in_output=True),
    )[0]
    assert inc.text == base.text[: cut + 2]
    # a stop string spanning a token boundary (", 6" is at least two tokens)
    span = smol_llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=20, stop=["5, 6"]))[0]
    assert span.text == base.text[: base.text.index("5, 6")]
    assert_idle(smol_llm)


def test_stream_never_passes_stop_string(smol_llm: LLM):
    eng = smol_llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, stop=["5, 6"])
    whole = smol_llm.generate("Count: 1, 2, 3,", params)[0].text
    rid = eng.add_request("Count: 1, 2, 3,", params)
    streamed = ""
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid:
                streamed += o.delta_text
                assert "5, 6" not in streamed
    assert streamed == whole and whole.endswith("4, ")


def test_max_tokens_and_model_len(smol_path):
    llm = LLM(smol_path, kv_cache_tokens=1024, max_model_len=40)
    ids = llm.tokenizer.encode("Tell me a long story about a dragon.")
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))[0]
    assert out.finish_reason == "length"
    assert len(ids) + len(out.token_ids) == 40
    with pytest.raises(InvalidRequestError, match="context"):
        llm.generate(list(range(100, 141)), GREEDY)
    # the engine keeps serving after the rejected request
    assert llm.generate(ids, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].token_ids
    assert_idle(llm)


def test_seed_reproducible_whatever_the_neighbours(smol_llm: LLM):
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = smol_llm.generate("Write a word:", p)[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=8 + i, ignore_eos=True) for i in range(5)]
    outs = smol_llm.generate(
        ["Hi", "A long long prompt about many things", "Write a word:", "x", "y", "z"],
        others[:2] + [p] + others[2:5],
    )
    assert outs[2].token_ids == alone
    assert_idle(smol_llm)


def test_bad_input_is_rejected_and_engine_keeps_serving(smol_llm: LLM):
    with pytest.raises(InvalidRequestError, match="empty"):
        smol_llm.generate("", GREEDY)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        smol_llm.generate([1, 2, 10**9], GREEDY)
    with pytest.raises(InvalidRequestError, match="context"):
        smol_llm.generate(list(range(100, 9000)), GREEDY)
    with pytest.raises(ValueError):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(ValueError):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=-1)
    assert smol_llm.generate("Hello", GREEDY)[0].token_ids
    assert_idle(smol_llm)


def test_context_is_what_the_kv_pool_holds_for_one_stream(smol_path):
    """A pool smaller than the model's context is the engine's context: a longer prompt is
    refused up front naming both numbers, and a stream alone may fill the whole pool (the
    others give way), finishing "length" only there."""
    llm = LLM(smol_path, kv_cache_tokens=64, block_size=16)
    assert llm.engine.max_model_len == 64  # the model's own is 8192
    with pytest.raises(InvalidRequestError, match=r"prompt has 100 tokens; the context is 64 "
                       r"tokens \(what this engine's KV pool holds for one stream; the "
                       r"model's own is 8192\)"):
        llm.generate(list(range(100, 200)), GREEDY)
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([list(range(100, 130)), list(range(300, 310))], [long, short])
    assert [len(o.token_ids) for o in outs] == [34, 8]  # 30 + 34 = 64: the context
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert_idle(llm)


def test_a_max_model_len_the_pool_cannot_hold_is_refused(smol_path):
    with pytest.raises(ConfigError, match=r"max_model_len=128 is more than this engine's device "
                       r"KV pool holds for one stream \(64 tokens"):
        LLM(smol_path, kv_cache_tokens=64, block_size=16, max_model_len=128)
    assert LLM(smol_path, kv_cache_tokens=64, block_size=16, max_model_len=48
               ).engine.max_model_len == 48


@pytest.mark.slow
def test_preemption_keeps_outputs_identical(smol_path, smol_llm: LLM):
    """A pool far too small for the batch forces preemption; outputs match the roomy run."""
    prompts = [f"Item {i}: the history of {w} is" for i, w in
               enumerate(["rome", "tea", "paper", "glass", "iron", "salt", "silk", "rice"])]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = [o.token_ids for o in smol_llm.generate(prompts, params)]
    # no admission headroom: the scheduler over-admits and must preempt
    small = LLM(smol_path, kv_cache_tokens=160, block_size=16, admission_lookahead_tokens=0)
    outs = small.generate(prompts, params)
    assert [o.token_ids for o in outs] == ref
    assert small.engine.scheduler.num_preemptions > 0
    assert_idle(small)
    for policy in ("least_computed", "largest"):
        other = LLM(smol_path, kv_cache_tokens=160, block_size=16, admission_lookahead_tokens=0,
                    preemption_policy=policy)
        assert [o.token_ids for o in other.generate(prompts[:4], params)] == ref[:4]
        assert_idle(other)


def test_priority_then_fcfs(smol_path):
    llm = LLM(smol_path, kv_cache_tokens=1024, max_num_seqs=1)
    eng = llm.engine
    p = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for rid, prio in [("low", 5), ("first", 0), ("second", 0), ("mid", 1)]:
        eng.add_request("Hello", p, request_id=rid, priority=prio)
    order = []
    while eng.has_unfinished():
        order += [o.request_id for o in eng.step() if o.finished]
    assert order == ["first", "second", "mid", "low"]


def test_abort_frees_blocks_mid_prefill_and_decode(smol_path):
    llm = LLM(smol_path, kv_cache_tokens=4096, max_num_batched_tokens=64)
    eng = llm.engine
    long_prompt = list(range(100, 400))  # needs several 64-token prefill chunks
    a = eng.add_request(long_prompt, GREEDY)
    b = eng.add_request("Hello there", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    eng.step()
    assert 0 < eng.kv.num_computed(a) < len(long_prompt)  # a is mid-prefill
    assert eng.abort(a)
    while eng.kv.num_computed(b) == 0 or not eng.seqs[b].output_ids:
        eng.step()
    assert eng.abort(b)  # b is mid-decode
    assert_idle(llm)
    assert not eng.abort("unknown")


def test_shared_prefix_served_from_cache_and_counted(smol_path):
    """A second request with the same 80-token prefix reuses its full blocks (usage.cached_tokens)
    and generates what a cache-less engine generates; stats() reports the hit rate."""
    llm = LLM(smol_path, kv_cache_tokens=2048, block_size=16)
    prefix = list(range(1000, 1080))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = llm.generate(prefix + [5000, 5001], params)[0]
    second = llm.generate(prefix + [6000, 6001, 6002], params)[0]
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == 80  # five whole 16-token blocks
    assert second.usage.prompt_tokens == 83
    cold = LLM(smol_path, kv_cache_tokens=2048, block_size=16, enable_prefix_caching=False)
    again = cold.generate(prefix + [6000, 6001, 6002], params)[0]
    assert again.usage.cached_tokens == 0
    assert again.token_ids == second.token_ids
    s = llm.engine.stats()
    for key in ("running", "waiting", "preemptions", "kv_blocks_used", "kv_blocks_free",
                "generation_tokens_per_s"):
        assert key in s
    assert s["running"] == s["waiting"] == 0
    assert s["prefix_cache_hit_rate"] > 0
    assert s["kv_blocks_used"] == 0
    assert_idle(llm)
