"""Qwen3-MoE and Mixtral against transformers: each tiny model from a sharded HF directory
(one tensor per expert) and from a GGUF converted with llama.cpp's names (stacked experts),
greedy float32 tokens of 8 mixed prompts in one batch with prefix caching on and evictions
forced through the host tier; the chat template as transformers renders it; the MoE
configuration both loaders read; GGUF experts quantized like dense layers."""

from __future__ import annotations

import pytest
import torch
from c_kernels import require_kernel
from moe_models import VARIANTS, arch_of, hf_class, make_moe_model, write_moe_gguf

from kvserve import LLM, SamplingParams
from kvserve.errors import InvalidRequestError, ModelLoadError
from kvserve.workers.loading.hf_loader import config_from_hf
from kvserve.workers.loading.loader import load_model
from kvserve.workers.loading.tokenizer import load_tokenizer
from kvserve.workers.model.layers.moe import SparseMoE

BS = 4
NEW = 8  # generated tokens per prompt


def _prompts() -> list[list[int]]:
    """8 prompts of 5 to 41 tokens; four share a 24-token prefix (six full blocks)."""
    import random

    rng = random.Random(5)
    shared = [rng.randrange(100, 40000) for _ in range(24)]
    out = []
    for i, n in enumerate([5, 41, 17, 30, 9, 36, 23, 33]):
        ids = [rng.randrange(100, 40000) for _ in range(n)]
        out.append(shared + ids[: n - 24] if i % 2 else ids)
    return out


PROMPTS = _prompts()


class _Built:
    """variant -> (HF directory, GGUF file, transformers' greedy tokens), built on first use."""

    def __init__(self, factory) -> None:
        self.factory = factory
        self.paths: dict[str, tuple[str, str]] = {}
        self.refs: dict[str, list[list[int]]] = {}

    def paths_of(self, variant: str) -> tuple[str, str]:
        if variant not in self.paths:
            root = self.factory.mktemp(variant)
            hf_dir = make_moe_model(root / "hf", variant, seed=13)
            self.paths[variant] = (hf_dir, write_moe_gguf(root / f"{variant}.gguf", hf_dir, variant))
        return self.paths[variant]

    def reference(self, variant: str) -> list[list[int]]:
        if variant not in self.refs:
            model = hf_class(variant).from_pretrained(self.paths_of(variant)[0], dtype=torch.float32)
            out = []
            with torch.no_grad():
                for ids in PROMPTS:
                    gen = model.eval().generate(torch.tensor([ids]), max_new_tokens=NEW,
                                                min_new_tokens=NEW, do_sample=False, pad_token_id=0)
                    out.append(gen[0, len(ids):].tolist())
            self.refs[variant] = out
        return self.refs[variant]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> _Built:
    return _Built(tmp_path_factory)


def _llm(path: str, **kw) -> LLM:
    # 20 blocks for 8 streams of up to 49 tokens: streams are parked to host and come back
    # copies forced: the tests check what comes back by copy, whatever this machine's speed
    return LLM(path, kv_cache_tokens=20 * BS, block_size=BS, host_cache_gib=0.001,
               host_restore_policy="copy", enable_prefix_caching=True, max_num_batched_tokens=32,
               admission_lookahead_tokens=0, dtype="float32", **kw)


# the dense-layer variant's GGUF reads the same weights and configuration as its HF directory
# (test_both_loaders_read_the_same_model), so one format runs it
@pytest.mark.parametrize("variant,fmt", [("qwen3_moe", "hf"), ("qwen3_moe", "gguf"),
                                         ("qwen3_moe_dense", "hf"), ("mixtral", "hf"),
                                         ("mixtral", "gguf")])
def test_greedy_matches_transformers(built: _Built, variant: str, fmt: str) -> None:
    hf_dir, gguf_path = built.paths_of(variant)
    want = built.reference(variant)
    llm = _llm(hf_dir if fmt == "hf" else gguf_path)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == want
    stats = llm.engine.stats()
    assert stats["evictions"] > 0 and stats["tokens_restored_copy"] > 0, stats
    assert sum(o.usage.cached_tokens for o in outs) > 0, "no prefix cache hit"
    assert stats["kv_blocks_used"] == 0 and stats["host_blocks_used"] == 0


def test_the_experts_and_their_weighting_decide_the_tokens(built: _Built) -> None:
    """The comparison above can fail: renormalising the top-k weights of the model that does
    not renormalise changes its greedy tokens."""
    hf_dir, _ = built.paths_of("qwen3_moe_dense")
    llm = LLM(hf_dir, block_size=BS, dtype="float32")
    mlps = [layer.mlp for layer in llm.engine.runner.model.layers]
    assert [isinstance(m, SparseMoE) for m in mlps] == [True, False, True]
    for m in mlps[::2]:
        m.renormalize = True
    outs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] != built.reference("qwen3_moe_dense")[:3]


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello. How can I help?"},
     {"role": "user", "content": "Name three colours."}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Largest planet?"}],
]


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral"])
def test_chat_template_renders_as_transformers(built: _Built, variant: str) -> None:
    """The family's template (tokenizer_config.json, and tokenizer.chat_template in the
    GGUF) renders as transformers renders it, refusals included (Mixtral: no system role)."""
    from transformers import AutoTokenizer

    hf_dir, gguf_path = built.paths_of(variant)
    hf_tok = AutoTokenizer.from_pretrained(hf_dir)
    ours = [load_tokenizer(hf_dir), load_tokenizer(gguf_path)]
    refused = 0
    for msgs in CONVERSATIONS:
        for gen_prompt in (True, False):
            try:
                want = hf_tok.apply_chat_template(msgs, tokenize=False,
                                                  add_generation_prompt=gen_prompt)
            except Exception as e:  # Mixtral's template: a system turn breaks the alternation
                assert "roles must alternate" in str(e)
                refused += 1
                for tok in ours:
                    with pytest.raises(InvalidRequestError, match="roles must alternate"):
                        tok.apply_chat_template(msgs, add_generation_prompt=gen_prompt)
                continue
            for tok in ours:
                assert tok.apply_chat_template(msgs, add_generation_prompt=gen_prompt) == want
    assert refused == (2 if variant == "mixtral" else 0)


EXPECTED = {
    # variant: (experts, top-k, expert width, renormalise, dense layers, layers)
    "qwen3_moe": (8, 2, 32, True, [], 2),
    "qwen3_moe_dense": (6, 2, 32, False, [1], 3),
    "mixtral": (4, 2, 48, True, [], 2),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_both_loaders_read_the_same_model(built: _Built, variant: str) -> None:
    """The sharded HF directory (per-expert tensors) and the GGUF (stacked experts) give the
    same MoE configuration and the same stacked weights."""
    hf_dir, gguf_path = built.paths_of(variant)
    hf, gg = load_model(hf_dir), load_model(gguf_path)
    for cfg in (hf.config, gg.config):
        assert cfg.architecture == arch_of(variant)
        got = (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
               cfg.norm_topk_prob, cfg.mlp_only_layers, cfg.num_layers)
        assert got == EXPECTED[variant]
        assert cfg.qk_norm == (arch_of(variant) == "qwen3_moe")
    assert hf.weights.keys() == gg.weights.keys()
    e, _, f, _, dense, layers = EXPECTED[variant]
    for i in range(layers):
        name = f"model.layers.{i}.mlp.experts.gate_proj.weight"
        assert (name in hf.weights) == (i not in dense)
        if i not in dense:
            assert tuple(hf.weights[name].shape) == (e, f, 64)
    for name, tensor in hf.weights.items():
        torch.testing.assert_close(gg.weights[name], tensor, atol=1e-6, rtol=0, msg=name)


def test_quantized_gguf_experts_load_like_dense_layers(built: _Built, tmp_path) -> None:
    """Q8_0 experts dequantize to the HF weights within the format's error and keep their raw
    rows, one 2-D weight per expert, for the CPU kernel that reads quantized rows at small
    batch; the MoE layer gives the same output through that kernel as through the
    dequantized weights."""
    import gguf

    from kvserve.workers.model.cpu_kernels import load_qgemv
    from kvserve.workers.model.models.registry import build_model

    require_kernel("qgemv", load_qgemv())
    hf_dir, _ = built.paths_of("qwen3_moe")
    q8 = write_moe_gguf(tmp_path / "q8.gguf", hf_dir, "qwen3_moe", gguf.GGMLQuantizationType.Q8_0,
                        tokenizer=False)
    hf, gg = load_model(hf_dir), load_model(q8)
    name = "model.layers.1.mlp.experts.down_proj.weight"
    torch.testing.assert_close(gg.weights[name], hf.weights[name], atol=0.01, rtol=0)
    assert gg.quantized["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (64, 32)
    assert len([k for k in gg.quantized if ".experts." in k]) == 2 * 8 * 3
    cpu = torch.device("cpu")
    kernel, plain = (build_model(gg.config, gg.weights, cpu, torch.float32, 64, gg.quantized, q)
                     .layers[1].mlp for q in (True, False))
    assert all(e.gate_up.quant is not None and e.down.quant is not None for e in kernel.experts)
    assert all(e.gate_up.quant is None for e in plain.experts)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(0))  # <= 16 rows per expert
    torch.testing.assert_close(kernel(x), plain(x), atol=1e-4, rtol=1e-4)


def test_moe_config_rules_and_errors() -> None:
    """decoder_sparse_step and mlp_only_layers as transformers reads them; bad values refused."""
    base = {"model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    cfg = config_from_hf({**base, "decoder_sparse_step": 2, "mlp_only_layers": [3]}, "c.json")
    assert cfg.mlp_only_layers == [0, 2, 3, 4]  # sparse: (i + 1) % 2 == 0, except layer 3
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert cfg.norm_topk_prob is False  # transformers' default for Qwen3-MoE
    mixtral = config_from_hf({**base, "model_type": "mixtral", "num_local_experts": 8}, "c.json")
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == (8, 128, True)
    with pytest.raises(ModelLoadError, match="num_experts_per_tok 5 must be in 1..4"):
        config_from_hf({**base, "num_experts_per_tok": 5}, "c.json")
    with pytest.raises(ModelLoadError, match="norm_topk_prob"):
        config_from_hf({**base, "norm_topk_prob": "yes"}, "c.json")


def test_missing_expert_is_named(built: _Built, tmp_path) -> None:
    """A checkpoint without one expert's tensor fails with that tensor's name."""
    import json
    import shutil

    hf_dir, _ = built.paths_of("mixtral")
    broken = tmp_path / "broken"
    shutil.copytree(hf_dir, broken)
    index_path = broken / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    gone = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    assert gone in index["weight_map"]
    # rewrite the shard holding it without that tensor
    from safetensors.torch import load_file, save_file

    shard = broken / index["weight_map"].pop(gone)
    tensors = load_file(str(shard))
    del tensors[gone]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=f"missing expert tensors {gone}"):
        load_model(str(broken))


def test_snapshot_moves_an_moe_stream(built: _Built, tmp_path) -> None:
    """A Mixtral stream exported mid-generation from the HF directory's engine resumes in an
    engine of the same model loaded from its GGUF, from its copied KV, with the tokens
    transformers gives. A Llama engine of the same KV geometry refuses a Mixtral snapshot,
    though llama.cpp names both `llama`."""
    from tiny_models import make_tiny_hf_model

    hf_dir, gguf_path = built.paths_of("mixtral")
    src = LLM(hf_dir, kv_cache_tokens=64 * BS, block_size=BS, host_cache_gib=0.001,
              dtype="float32", host_restore_policy="copy").engine
    dst = LLM(gguf_path, kv_cache_tokens=64 * BS, block_size=BS, host_cache_gib=0.001,
              dtype="float32", host_restore_policy="copy").engine
    src.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), "r")
    while not src.seqs["r"].output_ids:  # prefill, then one token
        src.step()
    dst.import_stream(src.export_stream("r"))
    assert not src.has_unfinished() and src.stats()["kv_blocks_used"] == 0
    done = []
    while dst.has_unfinished():
        done += [o for o in dst.step() if o.finished]
    assert [o.token_ids for o in done] == [built.reference("mixtral")[1]]
    stats = dst.stats()
    assert stats["tokens_restored_copy"] > 0 and stats["tokens_recomputed"] == 0, stats

    cfg = dst.model_config
    llama = LLM(make_tiny_hf_model(tmp_path / "llama", "llama", num_hidden_layers=cfg.num_layers,
                                   num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim),
                kv_cache_tokens=64 * BS, block_size=BS, host_cache_gib=0.001).engine
    dst.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=NEW), "m")
    dst.step()
    with pytest.raises(InvalidRequestError, match="'architecture': 'mixtral'"):
        llama.import_stream(dst.export_stream("m"))
    assert not llama.has_unfinished() and llama.stats()["host_blocks_used"] == 0


def test_roofline_counts_each_expert_once(built: _Built) -> None:
    """The decode roofline's weight bytes hold every expert's weights and the router once (the
    stacked tensors and the per-expert views of them) and the dense layer's MLP: transformers'
    parameters less the embedding table, from either format."""
    from kvserve.bench.roofline import weight_bytes
    from kvserve.workers.model.models.registry import build_model

    hf_dir, gguf_path = built.paths_of("qwen3_moe_dense")
    params = hf_class("qwen3_moe_dense").from_pretrained(hf_dir, dtype=torch.float32).named_parameters()
    want = 4 * sum(p.numel() for name, p in params if "embed_tokens" not in name)
    for path in (hf_dir, gguf_path):
        m = load_model(path)
        model = build_model(m.config, m.weights, torch.device("cpu"), torch.float32, 64, m.quantized)
        assert weight_bytes(model) == want
