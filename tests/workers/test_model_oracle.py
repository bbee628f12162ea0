"""kvserve's model runtime against transformers as the oracle."""

from __future__ import annotations

import pytest
import torch
from tiny_models import llama_cpp_mix, make_tiny_hf_model, write_gguf

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig
from kvserve.kvcache.manager import StreamStep
from kvserve.workers.loading.loader import load_model
from kvserve.workers.model.attention_torch import TorchAttention
from kvserve.workers.model.runner import ModelRunner

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three uses of copper:\n1.",
    "Translate to French: I like apples.",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "Q: What is 17 times 3?\nA:",
    "Écris un poème sur la mer 🌊:",
    "import numpy as np\n\nx = np.",
]


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize(
    "arch,kw",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"rope_scaling": "llama3"}),
        ("mistral", {}),
        ("qwen2", {}),
    ],
)
def test_tiny_model_logits_match_transformers(tmp_path, arch, kw):
    """Prompt logits and every greedy decode step's logits equal HF's within 1e-4."""
    import transformers

    path = make_tiny_hf_model(tmp_path / arch, arch, seed=3, **kw)
    hf = getattr(transformers, {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                "qwen2": "Qwen2ForCausalLM"}[arch]).from_pretrained(path).eval()
    runner = ModelRunner(load_model(path), EngineConfig(kv_cache_tokens=512, block_size=4))
    ids = [1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 378, 17, 29, 22]
    # prompt in two chunks: the second attends to the first through the paged cache
    runner.execute([StreamStep("s", ids, 5)])
    _, logits = runner.execute([StreamStep("s", ids, len(ids))])
    ref = hf_logits(hf, ids)
    torch.testing.assert_close(logits[0], ref[-1], atol=1e-4, rtol=0)
    for _ in range(12):
        ids = ids + [int(logits[0].argmax())]
        _, logits = runner.execute([StreamStep("s", ids, len(ids))])
        torch.testing.assert_close(logits[0], hf_logits(hf, ids)[-1], atol=1e-4, rtol=0)


def _greedy_matches_transformers(llm: LLM, hf, texts: list[str], n: int) -> None:
    tok = llm.tokenizer
    chats = [[{"role": "user", "content": "What is the boiling point of water?"}]]
    prompts = [tok.encode(p) for p in texts]
    prompts += [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in chats]
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for ids, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                pad_token_id=2,
            )[0, len(ids):].tolist()
        assert out.token_ids == ref, tok.decode(ids)
        assert out.finish_reason == "length"


def test_smollm2_greedy_matches_transformers(smol_llm_exact: LLM, hf_smol):
    """The default GGUF with float32 activations gives transformers' greedy tokens, batched:
    a text and a chat prompt here, every prompt below in the slow tier (transformers' own
    decode is the slow part)."""
    _greedy_matches_transformers(smol_llm_exact, hf_smol, PROMPTS[5:7], 16)


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers_on_every_prompt(smol_llm_exact: LLM, hf_smol):
    """With float32 activations the default GGUF gives transformers' greedy 32 tokens for
    varied prompts, batched."""
    _greedy_matches_transformers(smol_llm_exact, hf_smol, PROMPTS, 32)


# llama.cpp 0c1e570 (the benchmark docs' build) on these prompts and the chat prompt, 32
# greedy tokens against transformers on the dequantized weights: the mean common prefix
LLAMA_CPP_MEAN_PREFIX = 12.4


def _agreement(llm: LLM, hf) -> dict:
    """32 greedy tokens of PROMPTS and a chat prompt from both: how many agree, and the mean
    common prefix."""
    from kvserve.bench.common import identical

    tok = llm.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    prompts.append(tok.apply_chat_template(
        [{"role": "user", "content": "What is the boiling point of water?"}],
        add_generation_prompt=True, tokenize=True))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    refs = []
    for ids in prompts:
        with torch.no_grad():
            refs.append(hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32,
                                    do_sample=False, pad_token_id=2)[0, len(ids):].tolist())
    return identical(refs, [o.token_ids for o in outs])


@pytest.mark.slow
def test_smollm2_int8_agrees_with_transformers_as_well_as_llama_cpp(smol_llm: LLM, hf_smol):
    """The default's 8-bit activations move greedy decoding off transformers' path on some
    prompts, as llama.cpp's (the same scheme) do: on average no sooner than llama.cpp's do."""
    got = _agreement(smol_llm, hf_smol)
    assert got["mean_common_prefix"] >= LLAMA_CPP_MEAN_PREFIX, got


# llama.cpp 0c1e570 on the same prompts and the files below (the same bytes: the writer is
# deterministic), 32 greedy tokens against transformers on each file's dequantized weights
LLAMA_CPP_K_MIX_MEAN_PREFIX = {"Q4_K_M": 18.8, "Q3_K_M": 15.4}


@pytest.fixture(scope="module")
def smol_hf_dir(tmp_path_factory, hf_smol) -> str:
    """The default model's weights (dequantized by transformers) as a float32 HF folder."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("smol_hf")
    cfg = hf_smol.config.__class__.from_dict(hf_smol.config.to_dict())
    if hasattr(cfg, "quantization_config"):  # transformers will not save a GGUF load as it is
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(hf_smol.state_dict())
    model.save_pretrained(path)
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q3_K_M"])
def test_k_quant_mixes_of_smollm2_agree_with_transformers_as_well_as_llama_cpp(
        tmp_path, smol_path, smol_hf_dir, ftype):
    """The default model's weights written as llama.cpp writes a Q4_K_M / Q3_K_M file (its
    576-wide rows take the Q5_0, Q8_0, IQ4_NL and Q5_1 fallbacks, the 1536-wide down rows the
    K-quants): the whole model runs in the one-call int8 step, and its greedy tokens stay on
    transformers' path (on that file's dequantized weights) on average no shorter than
    llama.cpp's do."""
    import gguf
    from transformers import AutoModelForCausalLM

    fields = gguf.GGUFReader(smol_path).fields
    meta = {n: fields[n].contents() for n in fields if n.startswith("tokenizer.")}
    path = write_gguf(tmp_path / f"{ftype}.gguf", smol_hf_dir, llama_cpp_mix(ftype, 30, tied=True),
                      metadata=meta)
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert {"Q4_K", "Q6_K"} <= types if ftype == "Q4_K_M" else {"Q3_K", "IQ4_NL", "Q5_K"} <= types
    llm = LLM(path, kv_cache_tokens=4096, host_cache_gib=0)
    assert llm.engine.runner.runtime["decode_step"] == "one C call per decode step", llm.engine.runner.runtime
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=f"{ftype}.gguf", dtype=torch.float32).eval()
    got = _agreement(llm, hf)
    assert got["mean_common_prefix"] >= LLAMA_CPP_K_MIX_MEAN_PREFIX[ftype], got


@pytest.mark.parametrize("c_kernel", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["c-decode-kernel", "sdpa-only"])
def test_isolation_alone_vs_packed(smol_path, c_kernel):
    """A stream's logits are the same alone or packed with 15 streams of other lengths."""
    loaded = load_model(smol_path)
    g = torch.Generator().manual_seed(1)

    def rand(n: int) -> list[int]:
        return torch.randint(100, 40000, (n,), generator=g).tolist()

    target = rand(48)  # three full blocks: the decode token opens a fourth
    alone = ModelRunner(loaded, EngineConfig(kv_cache_tokens=4096, enable_prefix_caching=False))
    alone.attn = TorchAttention(use_kernel=c_kernel)
    _, ref_prefill = alone.execute([StreamStep("t", target, len(target))])
    ext = target + [int(ref_prefill[0].argmax())]
    _, ref_decode = alone.execute([StreamStep("t", ext, len(ext))])

    packed = ModelRunner(loaded, EngineConfig(kv_cache_tokens=8192, enable_prefix_caching=False))
    packed.attn = TorchAttention(use_kernel=c_kernel)
    assert (packed.attn.kernel is not None) == c_kernel, "the C kernel failed to build"
    others = {f"o{i}": rand(3 + 23 * i) for i in range(15)}
    # half the neighbours are already decoding, so the step mixes prefill and decode
    # and the target's blocks end up interleaved with theirs (a gathered, not viewed, table)
    packed.execute([StreamStep(k, v, len(v)) for k, v in list(others.items())[:8]])
    for k in list(others)[:8]:
        others[k] = others[k] + [5]
    steps = [StreamStep(k, v, len(v)) for k, v in others.items()]
    _, logits = packed.execute(steps[:7] + [StreamStep("t", target, len(target))] + steps[7:])
    torch.testing.assert_close(logits[7], ref_prefill[0], atol=1e-4, rtol=0)
    for k in others:
        others[k] = others[k] + [9]
    steps = [StreamStep(k, v, len(v)) for k, v in others.items()]
    _, logits = packed.execute([StreamStep("t", ext, len(ext))] + steps)
    torch.testing.assert_close(logits[0], ref_decode[0], atol=1e-4, rtol=0)
    table = packed.kv.block_table("t")
    assert table != list(range(table[0], table[0] + len(table))), "decode read a gathered table"
