"""Sliding-window attention end to end on a tiny Mistral whose window (16 tokens) is far
shorter than its prompts and outputs: greedy tokens equal transformers' past the window,
every layer being windowed the blocks no window reaches are released while the streams
run (so a stream holds about window / block_size blocks), and streams evicted after
releasing blocks are recomputed to the same tokens."""

from __future__ import annotations

import random

import pytest
import torch
from engine_runs import run_to_end
from tiny_models import make_tiny_hf_model

from kvserve import LLM, SamplingParams

WINDOW, BS, NEW = 16, 4, 12


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> str:
    return make_tiny_hf_model(tmp_path_factory.mktemp("swa") / "m", "mistral", seed=4,
                              sliding_window=WINDOW)


@pytest.fixture(scope="module")
def prompts_and_ref(mistral):
    from transformers import MistralForCausalLM

    rng = random.Random(2)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (3, 37, 20, 52, 9, 28)]
    model = MistralForCausalLM.from_pretrained(mistral, dtype=torch.float32).eval()
    assert model.config.sliding_window == WINDOW
    ref = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW,
                                 do_sample=False, pad_token_id=0)
            ref.append(out[0, len(ids):].tolist())
    return prompts, ref


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def test_outputs_past_the_window_and_blocks_released(mistral, prompts_and_ref) -> None:
    prompts, ref = prompts_and_ref
    llm = LLM(mistral, kv_cache_tokens=256 * BS, block_size=BS, max_num_batched_tokens=24,
              host_cache_gib=0)
    eng = llm.engine
    assert eng.kv.window == WINDOW
    for i, ids in enumerate(prompts):
        eng.add_request(ids, _greedy(), f"r{i}")
    most_live = 0

    def window_held(eng) -> None:
        nonlocal most_live
        for s in eng.kv.streams.values():
            # the window's keys span at most ceil(16 / 4) + 1 blocks, plus the step's new one
            most_live = max(most_live, len(s.live_blocks))
            assert s.num_dropped == max(0, (s.num_computed - WINDOW + 1) // BS)

    got = run_to_end(eng, window_held)
    assert [got[f"r{i}"] for i in range(len(prompts))] == ref
    assert most_live <= -(-WINDOW // BS) + 2
    stats = eng.stats()
    assert stats["kv_blocks_dropped"] > 0 and stats["kv_blocks_used"] == 0


def test_evicted_windowed_streams_recompute_to_the_same_tokens(mistral, prompts_and_ref) -> None:
    """A pool too small for all six: streams are evicted (some after releasing blocks, which
    park nothing and recompute), and each output is still transformers'."""
    prompts, ref = prompts_and_ref
    llm = LLM(mistral, kv_cache_tokens=16 * BS, block_size=BS, max_num_batched_tokens=24,
              host_cache_gib=0.001, admission_lookahead_tokens=0)
    outs = llm.generate(prompts, _greedy())
    assert [o.token_ids for o in outs] == ref
    stats = llm.engine.stats()
    assert stats["evictions"] > 0 and stats["kv_blocks_dropped"] > 0, stats
    assert stats["kv_blocks_used"] == 0 and stats["host_blocks_used"] == 0
