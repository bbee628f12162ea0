"""The newer dense families (Qwen3, Gemma 2, Gemma 3, Phi-3) against transformers: each from
a sharded HF directory and from a GGUF converted with llama.cpp's names, greedy float32
tokens of 8 mixed prompts in one batch (prefix caching on, evictions forced through the host
tier, prompts longer than the sliding windows), the family's chat template as transformers
renders it, the configuration each loader reads, and a snapshot of another architecture
refused."""

from __future__ import annotations

import os
import random

import pytest
import torch
from arch_models import ARCHS, WINDOW, hf_class, make_arch_model, write_arch_gguf

from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.workers.loading.loader import load_model
from kvserve.workers.loading.tokenizer import load_tokenizer

BS = 4
NEW = 8  # generated tokens per prompt


class _Built:
    """arch -> (HF directory, GGUF file, transformers' greedy tokens), built on first use."""

    def __init__(self, factory) -> None:
        self.factory = factory
        self.paths: dict[str, tuple[str, str]] = {}
        self.refs: dict[str, list[list[int]]] = {}

    def paths_of(self, arch: str) -> tuple[str, str]:
        if arch not in self.paths:
            root = self.factory.mktemp(arch)
            hf_dir = make_arch_model(root / "hf", arch, seed=11)
            self.paths[arch] = (hf_dir, write_arch_gguf(root / f"{arch}.gguf", hf_dir, arch))
        return self.paths[arch]

    def reference(self, arch: str) -> list[list[int]]:
        if arch not in self.refs:
            model = hf_class(arch).from_pretrained(self.paths_of(arch)[0], dtype=torch.float32)
            out = []
            with torch.no_grad():
                for ids in PROMPTS:
                    gen = model.eval().generate(torch.tensor([ids]), max_new_tokens=NEW,
                                                min_new_tokens=NEW, do_sample=False, pad_token_id=0)
                    out.append(gen[0, len(ids):].tolist())
            self.refs[arch] = out
        return self.refs[arch]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> _Built:
    return _Built(tmp_path_factory)


def _prompts() -> list[list[int]]:
    """8 prompts of 5 to 41 tokens; four share a 24-token prefix (six full blocks), so
    prefix caching has hits, and most are longer than the 16-token windows."""
    rng = random.Random(5)
    shared = [rng.randrange(100, 40000) for _ in range(24)]
    out = []
    for i, n in enumerate([5, 41, 17, 30, 9, 36, 23, 33]):
        ids = [rng.randrange(100, 40000) for _ in range(n)]
        out.append(shared + ids[: n - 24] if i % 2 else ids)
    return out


PROMPTS = _prompts()


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(built: _Built, arch: str, fmt: str) -> None:
    hf_dir, gguf_path = built.paths_of(arch)
    want = built.reference(arch)
    # 20 blocks for 8 streams of up to 49 tokens: streams are parked to host and come back
    llm = LLM(hf_dir if fmt == "hf" else gguf_path, kv_cache_tokens=20 * BS, block_size=BS,
              host_cache_gib=0.001, host_restore_policy="copy", enable_prefix_caching=True,
              max_num_batched_tokens=32,
              admission_lookahead_tokens=0, dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == want
    stats = llm.engine.stats()
    assert stats["evictions"] > 0 and stats["tokens_restored_copy"] > 0, stats
    assert sum(o.usage.cached_tokens for o in outs) > 0, "no prefix cache hit"
    assert stats["kv_blocks_used"] == 0 and stats["host_blocks_used"] == 0


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello. How can I help?"},
     {"role": "user", "content": "  Name three colours.  "}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Largest planet?"}],
]


@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template_renders_as_transformers(built: _Built, arch: str) -> None:
    """The family's template (tokenizer_config.json, and tokenizer.chat_template in the
    GGUF) renders every conversation as transformers does, refusals included."""
    from transformers import AutoTokenizer

    hf_dir, gguf_path = built.paths_of(arch)
    hf_tok = AutoTokenizer.from_pretrained(hf_dir)
    ours = [load_tokenizer(hf_dir), load_tokenizer(gguf_path)]
    for msgs in CONVERSATIONS:
        for gen_prompt in (True, False):
            try:
                want = hf_tok.apply_chat_template(msgs, tokenize=False,
                                                  add_generation_prompt=gen_prompt)
            except Exception as e:  # the template refuses (Gemma 2: no system role)
                assert "System role not supported" in str(e)
                for tok in ours:
                    with pytest.raises(InvalidRequestError, match="System role not supported"):
                        tok.apply_chat_template(msgs, add_generation_prompt=gen_prompt)
                continue
            for tok in ours:
                assert tok.apply_chat_template(msgs, add_generation_prompt=gen_prompt) == want
    if arch == "qwen3":  # a template variable passed through (thinking off)
        msgs = CONVERSATIONS[0]
        want = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                          enable_thinking=False)
        assert "<think>" in want
        for tok in ours:
            assert tok.apply_chat_template(msgs, enable_thinking=False) == want


EXPECTED = {
    # arch: (qk_norm, rotary dims, window, layer types, q scale, attention / final soft-cap)
    "qwen3": (True, 32, None, None, 32**-0.5, None, None),
    "gemma2": (False, 16, WINDOW, ["sliding_attention", "full_attention"], 24**-0.5, 2.0, 5.0),
    "gemma3": (True, 16, WINDOW, ["sliding_attention", "full_attention"], 24**-0.5, None, 5.0),
    "phi3": (False, 8, WINDOW, ["sliding_attention"] * 2, 16**-0.5, None, None),
}


@pytest.mark.parametrize("arch", ARCHS)
def test_both_loaders_read_the_same_model(built: _Built, arch: str) -> None:
    """The HF directory and the GGUF give the same configuration and the same weights
    (llama.cpp's Gemma norms are stored as 1 + w; both loaders return HF's w)."""
    hf_dir, gguf_path = built.paths_of(arch)
    assert sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors")) != ["model.safetensors"]
    hf, gg = load_model(hf_dir), load_model(gguf_path)
    for cfg in (hf.config, gg.config):
        qk, rot, window, types, scale, cap, final = EXPECTED[arch]
        assert cfg.architecture == arch
        assert (cfg.qk_norm, cfg.rotary_dims, cfg.sliding_window, cfg.layer_types) == (qk, rot, window, types)
        assert cfg.attention_scale == pytest.approx(scale, rel=1e-6)
        assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (cap, final)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "rope_theta", "tie_word_embeddings", "hidden_act",
                  "embed_scale", "norm_offset", "sandwich_norms", "rope_local_theta",
                  "max_position_embeddings"):
        assert getattr(hf.config, field) == pytest.approx(getattr(gg.config, field)), field
    if arch == "phi3":  # LongRoPE: the default context is the pre-training one
        assert hf.config.max_position_embeddings == 64
        for cfg in (hf.config, gg.config):
            rs = cfg.rope_scaling
            assert rs["rope_type"] == "longrope" and rs["original_max_position_embeddings"] == 64
            assert list(rs["short_factor"]) == pytest.approx([1.0, 1.1, 1.5, 2.0])
    assert hf.weights.keys() == gg.weights.keys()
    for name, tensor in hf.weights.items():
        torch.testing.assert_close(gg.weights[name], tensor, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("arch", ARCHS[-1:])
def test_snapshot_of_another_architecture_is_refused(built: _Built, arch: str, tmp_path) -> None:
    """A parked stream's snapshot carries its architecture: an engine of another family with
    the same KV geometry refuses it, and keeps nothing."""
    from tiny_models import make_tiny_hf_model

    hf_dir, _ = built.paths_of(arch)
    src = LLM(hf_dir, kv_cache_tokens=64 * BS, block_size=BS, host_cache_gib=0.001).engine
    cfg = src.model_config
    # a Llama with the same KV geometry (layers, KV heads, head dim, vocabulary)
    llama = make_tiny_hf_model(tmp_path / "llama", "llama", num_hidden_layers=cfg.num_layers,
                               num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    dst = LLM(llama, kv_cache_tokens=64 * BS, block_size=BS, host_cache_gib=0.001).engine
    src.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), "r")
    src.step()
    data = src.export_stream("r")
    with pytest.raises(InvalidRequestError, match=f"'architecture': '{arch}'"):
        dst.import_stream(data)
    assert not dst.has_unfinished() and dst.stats()["host_blocks_used"] == 0
