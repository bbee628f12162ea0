"""Tensor parallelism on CUDA (needs 2 GPUs): NCCL collectives, eagerly and inside CUDA graphs.

Float32 greedy tokens of a size-2 engine equal the single-GPU engine's, eager and with decode
and mixed graphs (whose captures hold the all-reduces); bfloat16 decode graphs give the
size-2 eager tokens; a killed rank fails the engine (the watcher aborts the NCCL group)
instead of leaving rank 0 in a collective. The model is a tiny random Llama (tokenizer from
`KVSERVE_TEST_TOKENIZER` on a host without the default model), or the HF directory in
`KVSERVE_CUDA_TEST_MODEL` when its heads split in two."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from tiny_models import make_tiny_hf_model

from kvserve import LLM, SamplingParams
from kvserve.errors import EngineDeadError

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

PROMPTS = [[(7 * i + 13 * j) % 40000 + 100 for j in range(n)]
           for i, n in enumerate([3, 9, 17, 33, 64, 100])]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return os.environ.get("KVSERVE_CUDA_TEST_MODEL") or make_tiny_hf_model(
        tmp_path_factory.mktemp("tp_cuda"), "llama", seed=4, num_attention_heads=8,
        num_key_value_heads=2, hidden_size=128, intermediate_size=256)


def greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, greedy())]


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_float32_size_2_equals_one_gpu(model, eager):
    want = tokens(LLM(model, device="cuda", dtype="float32", kv_cache_tokens=4096))
    with LLM(model, device="cuda", dtype="float32", kv_cache_tokens=4096,
             tensor_parallel_size=2, enforce_eager=eager) as llm:
        assert (llm.engine.runner.graphs is None) == eager
        assert tokens(llm) == want


def test_bfloat16_decode_graphs_equal_eager(model):
    kw = dict(device="cuda", dtype="bfloat16", kv_cache_tokens=4096, tensor_parallel_size=2)
    with LLM(model, enforce_eager=True, **kw) as llm:
        want = tokens(llm)
    with LLM(model, cuda_graph_max_tokens=0, **kw) as llm:
        assert tokens(llm) == want


def test_a_killed_rank_fails_the_engine(model):
    with LLM(model, device="cuda", kv_cache_tokens=4096, tensor_parallel_size=2) as llm:
        eng = llm.engine
        eng.add_request(PROMPTS[3], greedy(200))
        eng.step()
        (pid,) = eng.shard_pids()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="rank 1"):
            for _ in range(200):
                eng.step()
