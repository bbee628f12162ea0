"""The CUDA path end to end (needs a GPU): greedy float32 tokens equal transformers' for 16
mixed-length prompts batched together, bfloat16 logits within tolerance of transformers'
bfloat16 logits, CUDA graphs (decode and mixed steps) equal to eager steps, and asynchronous
scheduling equal to synchronous.

The model is the default GGUF, or the HF directory in `KVSERVE_CUDA_TEST_MODEL` (a GPU host
without the default model's package uses a random-weight model made with transformers)."""

from __future__ import annotations

import os

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.kvcache.manager import StreamStep

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")



@pytest.fixture(scope="module")
def model_path(request) -> str:
    return os.environ.get("KVSERVE_CUDA_TEST_MODEL") or request.getfixturevalue("smol_path")


PROMPT_LENS = [3, 7, 12, 18, 25, 31, 40, 47, 55, 64, 80, 96, 111, 128, 150, 200]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, 40000, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    if os.path.isdir(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        folder, name = os.path.split(path)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    return model.to("cuda").eval()


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("backend", ["triton", "torch"])  # torch: SDPA's transposed output
def test_float32_greedy_batched_equals_transformers(model_path, backend) -> None:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(model_path, device="cuda", dtype="float32", kv_cache_tokens=8192,
              attention_backend=backend)
    assert llm.engine.runner.attn.name == backend
    got = [o.token_ids for o in llm.generate(_prompts(), params)]  # all 16 batched together
    hf = _hf(model_path, torch.float32)
    want = [_hf_greedy(hf, p, 16) for p in _prompts()]
    assert got == want


def test_bfloat16_logits_within_tolerance(model_path) -> None:
    """Last-prompt-token logits of a batched prefill against transformers in bfloat16 on the
    same GPU: bfloat16 keeps 8 mantissa bits, so logits of magnitude ~10-20 differ by
    O(0.1) between two correct implementations; the tolerance is 0.25 absolute plus 2 %."""
    llm = LLM(model_path, device="cuda", dtype="bfloat16", kv_cache_tokens=8192)
    runner = llm.engine.runner
    prompts = _prompts()
    _, logits = runner.execute([StreamStep(f"s{i}", p, len(p)) for i, p in enumerate(prompts)])
    hf = _hf(model_path, torch.bfloat16)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([p], device="cuda")).logits[0, -1].float()
        torch.testing.assert_close(logits[i], ref, atol=0.25, rtol=0.02)


# bfloat16 results depend on GEMM shapes, and a mixed graph pads the step's token count: the
# bfloat16 case compares decode graphs only; float32 covers mixed graphs too
@pytest.mark.parametrize("dtype,mixed", [("float32", 2048), ("bfloat16", 0)])
def test_cuda_graph_decode_equals_eager(model_path, dtype, mixed) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = []
    for eager in (True, False):
        llm = LLM(model_path, device="cuda", dtype=dtype, kv_cache_tokens=8192, enforce_eager=eager,
                  cuda_graph_max_tokens=mixed, async_scheduling=False)
        graphs = llm.engine.runner.graphs
        assert (graphs is None) == eager
        kinds: list[int] = []
        if graphs is not None:
            run = graphs.run

            def counted(step, key, run=run, kinds=kinds):
                kinds.append(key.block_q)
                return run(step, key)

            graphs.run = counted
        outs.append([o.token_ids for o in llm.generate(_prompts(), params)])
        if not eager:
            assert 1 in kinds  # decode steps replayed graphs
            assert (16 in kinds) == bool(mixed)  # and so did the prefill steps, with mixed graphs
    assert outs[0] == outs[1]


def test_verify_steps_replay_graphs_with_the_eager_tokens(model_path) -> None:
    """n-gram speculation on prompts that repeat themselves, every proposal verified: the
    verify steps replay their buckets' graphs and give the eager engine's tokens (float32),
    which are plain decoding's."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = [p * 3 for p in _prompts()[:6]]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
    outs = []
    for eager, speculate in ((True, False), (True, True), (False, True)):
        llm = LLM(model_path, device="cuda", dtype="float32", kv_cache_tokens=8192,
                  enforce_eager=eager, async_scheduling=False,
                  speculative_config=spec if speculate else None)
        kinds: list[str] = []
        graphs = llm.engine.runner.graphs
        if graphs is not None:
            assert graphs.verify  # speculation configured: verify buckets captured
            run = graphs.run

            def counted(step, key, run=run, kinds=kinds):
                kinds.append(key.kind)
                return run(step, key)

            graphs.run = counted
        if speculate:
            llm.engine.spec.policy.always = True
        outs.append([o.token_ids for o in llm.generate(prompts, params)])
        if speculate:
            assert llm.engine.spec.stats()["spec_draft_tokens"] > 0
        if not eager:
            assert "verify" in kinds
        assert llm.engine.kv.pool.num_used == 0
    assert outs[0] == outs[1] == outs[2]


def test_async_scheduling_equals_sync(model_path) -> None:
    """float32 with decode and mixed graphs: each step launched before the last one's ids
    reach the host (those stay on the device as its inputs) gives the synchronous engine's
    tokens, with streams finishing at different steps."""
    params = [SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True) for i in range(16)]
    outs = []
    for overlap in (False, True):
        llm = LLM(model_path, device="cuda", dtype="float32", kv_cache_tokens=8192,
                  async_scheduling=overlap)
        assert llm.engine.async_scheduling == overlap
        outs.append([o.token_ids for o in llm.generate(_prompts(), params)])
        assert llm.engine.kv.pool.num_used == 0
    assert outs[0] == outs[1]
    assert [len(o) for o in outs[1]] == [6 + i for i in range(16)]
