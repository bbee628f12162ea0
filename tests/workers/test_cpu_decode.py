"""The whole-step CPU decode kernel (csrc/decode_step.c via workers/model/cpu_decode.py)
against the op-by-op forward with the same matmul kernels, on the default model and on
quantized GGUFs of every dense family; and the int8 path's batch and thread invariance."""

from __future__ import annotations

import gguf
import pytest
import torch
from arch_models import make_arch_model, write_arch_gguf
from c_kernels import require_kernel
from tiny_models import make_tiny_hf_model, write_gguf

from kvserve.config import EngineConfig
from kvserve.kvcache.manager import StreamStep
from kvserve.workers.loading.loader import load_model
from kvserve.workers.model.cpu_kernels import load_decode_step
from kvserve.workers.model.runner import ModelRunner

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def lib():
    return require_kernel("decode_step", load_decode_step())


@pytest.fixture(scope="module")
def smol(smol_path):
    return load_model(smol_path)


def _runner(loaded, fused: bool, **kw) -> ModelRunner:
    r = ModelRunner(loaded, EngineConfig(kv_cache_tokens=4096, enable_prefix_caching=False,
                                         host_cache_gib=0, **kw))
    if fused:
        assert r.model.cpu_step is not None and r.model.cpu_step.why_not is None, \
            r.model.cpu_step and r.model.cpu_step.why_not
    else:
        r.model.cpu_step = None
    return r


def _decode(runner: ModelRunner, prompts: dict[str, list[int]], n: int,
            forced: list[list[int]] | None = None) -> list[torch.Tensor]:
    """Prefill each prompt, then n decode steps of all streams together; the fed tokens are
    `forced` (the same for runners being compared) or greedy. Logits of every step."""
    toks = {s: list(p) for s, p in prompts.items()}
    for s, t in toks.items():
        runner.execute([StreamStep(s, t, len(t))])
    seen = []
    for i in range(n):
        for j, t in enumerate(toks.values()):
            t.append(forced[i][j] if forced else (t[-1] * 7 + 3) % 30000 + 100)
        _, logits = runner.execute([StreamStep(s, t, len(t)) for s, t in toks.items()])
        seen.append(logits)
    for s in toks:
        runner.free(s)
    return seen


def _prompts(n: int, g: torch.Generator) -> dict[str, list[int]]:
    return {f"s{i}": torch.randint(100, 40000, (3 + 11 * i,), generator=g).tolist() for i in range(n)}


@pytest.mark.parametrize("mode", ["int8", "exact"])
@pytest.mark.parametrize("streams", [1, 3, 9])
def test_default_model_step_is_op_by_op_bit_for_bit(lib, smol, streams: int, mode: str) -> None:
    """The one-call step gives the op-by-op forward's bits (the same kernels, norms, RoPE
    and activation code in both), with 8-bit or float32 activations."""
    prompts = _prompts(streams, torch.Generator().manual_seed(streams))
    got = _decode(_runner(smol, True, cpu_matmul=mode), prompts, 3)
    want = _decode(_runner(smol, False, cpu_matmul=mode), prompts, 3)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_the_steps_threads_read_only_the_repacked_copy(lib, smol) -> None:
    """The step's threads share the output rows of `o`, `down` and the head out in whole
    groups of 8, so every share reads the repacked copy: on 5 threads (576 and 49152 rows,
    which N t / T would cut mid-group) the step gives the same bits with those linears'
    original blocks swapped for zeros."""
    prompts = _prompts(2, torch.Generator().manual_seed(5))
    prev = torch.get_num_threads()
    torch.set_num_threads(5)
    try:
        want = _decode(_runner(smol, True, cpu_matmul="int8"), prompts, 2)
        r = _runner(smol, True, cpu_matmul="int8")
        step = r.model.cpu_step
        zeros = []  # alive while the step reads them
        lins = [step.model.head] + [lin for ly in step.layers for lin in (ly.o, ly.down)]
        for lin in lins:
            assert lin.wp and lin.N % 8 == 0
            zeros.append(torch.zeros(lin.N * lin.row_bytes, dtype=torch.uint8))
            lin.w = zeros[-1].data_ptr()
        assert step.layers[0].o.w == zeros[1].data_ptr()  # the structures were changed in place
        got = _decode(r, prompts, 2)
    finally:
        torch.set_num_threads(prev)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_int8_step_is_close_to_float32(lib, smol) -> None:
    """8-bit activations move the logits by their rounding, far less than a broken step."""
    _assert_int8_close(smol, 5, 0.1)


def _assert_int8_close(loaded, streams: int, tol: float) -> None:
    """Three decode steps of `streams` random prompts: the int8 step's logits within `tol`
    (relative norm) of the float32 forward on dequantized weights."""
    prompts = _prompts(streams, torch.Generator().manual_seed(streams))
    got = _decode(_runner(loaded, True, cpu_matmul="int8"), prompts, 3)
    ref = _decode(_runner(loaded, False, quantized_decode=False), prompts, 3)
    for g, r in zip(got, ref, strict=True):
        assert ((g - r).norm(dim=-1) <= tol * r.norm(dim=-1)).all()


def test_int8_step_does_not_depend_on_batch_or_threads(lib, smol) -> None:
    """A stream's logits are the same bits decoded alone, with 8 others (the repacked
    weights' row-major path), with 64 others (two passes of rows), beside another
    stream's prompt chunk (its rows in the same step) and on one thread: its tokens do not depend
    on the load it shares a step with."""
    assert _runner(smol, True, cpu_matmul="int8").model.cpu_step.model.all_packed == 1
    assert _runner(smol, True, cpu_matmul="exact").model.cpu_step.model.all_packed == 0
    g = torch.Generator().manual_seed(7)
    target = {"t": torch.randint(100, 40000, (20,), generator=g).tolist()}
    others = {f"o{i}": torch.randint(100, 40000, (4 + i % 9,), generator=g).tolist() for i in range(64)}
    forced = [[(31 * i + 7 * j) % 30000 + 100 for j in range(65)] for i in range(4)]
    alone = _decode(_runner(smol, True, cpu_matmul="int8"), target, 4, forced)
    nine = _decode(_runner(smol, True, cpu_matmul="int8"),
                   {**target, **dict(list(others.items())[:8])}, 4, forced)
    many = _decode(_runner(smol, True, cpu_matmul="int8"), {**target, **others}, 4, forced)
    torch.set_num_threads(1)
    try:
        one_thread = _decode(_runner(smol, True, cpu_matmul="int8"), target, 4, forced)
    finally:
        torch.set_num_threads(2)
    for a, n, m, o in zip(alone, nine, many, one_thread, strict=True):
        assert torch.equal(a[0], n[0])
        assert torch.equal(a[0], m[0])
        assert torch.equal(a[0], o[0])
    # a step that also holds a 40-token prompt chunk (its rows attend one by one as well)
    r = _runner(smol, True, cpu_matmul="int8")
    toks = list(target["t"])
    r.execute([StreamStep("t", toks, len(toks))])
    toks.append(forced[0][0])
    chunk = torch.randint(100, 40000, (40,), generator=g).tolist()
    _, logits = r.execute([StreamStep("t", toks, len(toks)), StreamStep("p", chunk, 40)])
    assert torch.equal(logits[0], alone[0][0])


def test_exact_path_leaves_large_batches_to_mkl(lib, smol) -> None:
    r = _runner(smol, True, cpu_matmul="exact")
    prompts = {f"s{i}": [100 + i, 200, 300] for i in range(17)}
    calls = []
    step = r.model.cpu_step
    real = step.__call__

    class Spy:
        why_not = None

        def accepts(self, meta, n):
            ok = step.accepts(meta, n)
            calls.append((n, ok))
            return ok

        def __call__(self, *a):
            return real(*a)

    r.model.cpu_step = Spy()  # type: ignore[assignment]
    _decode(r, prompts, 1)
    assert (17, False) in calls  # 17 decode rows: over the exact kernel's 16


# ---- every dense family, quantized -------------------------------------------------------
# head_dim 32 (the step's attention quantizes whole 32-blocks per head); Phi-3 rotates 16
_PHI_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
             "short_factor": [1.0, 1.1, 1.5, 2.0, 2.0, 2.5, 3.0, 3.0],
             "long_factor": [1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0, 8.0]}
FAMILIES = {
    "qwen3": {"head_dim": 32},
    "gemma2": {"head_dim": 32},
    "gemma3": {"head_dim": 32},
    "phi3": {"hidden_size": 128, "rope_parameters": _PHI_ROPE},
}


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    paths = {}
    for arch, overrides in FAMILIES.items():
        hf = make_arch_model(root / arch, arch, seed=5, with_tokenizer=False, **overrides)
        paths[arch] = write_arch_gguf(root / f"{arch}.gguf", hf, arch, Q.Q8_0)
    for arch, kw in {"llama": {}, "qwen2": {}, "mistral": {"sliding_window": 8}}.items():
        hf = make_tiny_hf_model(root / arch, arch, seed=6, with_tokenizer=False,
                                num_attention_heads=2, num_key_value_heads=1, **kw)
        paths[arch] = write_gguf(root / f"{arch}.gguf", hf, Q.Q4_0)
    return paths


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", *FAMILIES])
def test_family_step_matches_op_by_op(lib, family_models, arch: str) -> None:
    """q/k norms, QKV biases, sandwich norms, soft-caps, GeGLU, windows, per-layer RoPE,
    partial rotary: the op-by-op forward's bits past the windows, in both matmul modes; and
    the 8-bit path near float32."""
    loaded = load_model(family_models[arch])
    prompts = _prompts(3, torch.Generator().manual_seed(11))
    steps = 20  # past the 8- and 16-token windows
    for mode in ("exact", "int8"):
        got = _decode(_runner(loaded, True, cpu_matmul=mode), prompts, steps)
        want = _decode(_runner(loaded, False, cpu_matmul=mode), prompts, steps)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), mode
    ref = _decode(_runner(loaded, False, quantized_decode=False), prompts, steps)
    for g, r in zip(got, ref, strict=True):
        assert ((g - r).norm(dim=-1) <= 0.1 * r.norm(dim=-1) + 1e-3).all()


@pytest.mark.parametrize("arch", ["default", "gemma2", "mistral"])
@pytest.mark.parametrize("fused", [True, False])
def test_int8_prompt_rows_do_not_depend_on_the_chunk(lib, smol, family_models, arch: str,
                                                     fused: bool) -> None:
    """With 8-bit activations a prompt's logits, and the tokens decoded after it, are the
    same bits prefilled in one chunk, in uneven chunks, token by token, or after another
    prompt computed (and cached) its first blocks: a cached prefix does not change a
    request's greedy text. Through the one-call step and op by op; soft-caps and windows
    (Gemma 2, Mistral) included."""
    loaded = smol if arch == "default" else load_model(family_models[arch])
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(100, 40000, (45,), generator=g).tolist()
    forced = [7000, 123, 4242]

    def run(cuts: list[int], shared: list[int] | None = None) -> list[torch.Tensor]:
        r = ModelRunner(loaded, EngineConfig(kv_cache_tokens=4096, host_cache_gib=0, block_size=16,
                                             cpu_matmul="int8",
                                             enable_prefix_caching=shared is not None))
        if not fused:
            r.model.cpu_step = None
        if shared is not None:  # another prompt with the same first 32 tokens, then freed
            r.execute([StreamStep("other", shared, len(shared))])
            r.free("other")
        toks = list(prompt)
        seen = []
        for cut in cuts:
            plan, logits = r.execute([StreamStep("s", toks, cut)])
            if cut == len(prompt) and shared is not None:
                assert plan.streams[0].start >= 32  # the shared blocks came from the cache
        seen.append(logits[0])
        for t in forced:
            toks.append(t)
            _, logits = r.execute([StreamStep("s", toks, len(toks))])
            seen.append(logits[0])
        return seen

    whole = run([45])
    other = prompt[:32] + torch.randint(100, 40000, (20,), generator=g).tolist()
    for got in (run([7, 30, 45]), run(list(range(1, 46))), run([45], shared=other)):
        for a, b in zip(whole, got, strict=True):
            assert torch.equal(a, b)


def test_prompt_rows_one_by_one_only_with_8_bit_matmuls(lib, smol) -> None:
    """Prompt rows attend through the C kernel where the 8-bit matmuls run (the default on
    GGUF blocks); float32 activations or dequantized weights keep SDPA for prompt chunks."""
    assert _runner(smol, True, cpu_matmul="int8").attn.prefill_rows
    assert not _runner(smol, True, cpu_matmul="exact").attn.prefill_rows
    assert not _runner(smol, False, quantized_decode=False).attn.prefill_rows


def test_without_memory_for_the_copy_the_step_runs_on_the_original_blocks(lib, smol,
                                                                          monkeypatch) -> None:
    """Repacked copies that would take more than half the available memory are not made:
    the engine still runs the one-call step, says why it has no copy, and its logits are the
    same bits as with the copy (9 streams: the interleaved layout without it)."""
    from kvserve.workers.model import cpu_decode

    with_copy = _runner(smol, True, cpu_matmul="int8")
    need = with_copy.model.cpu_step.repacked_bytes
    assert 91 * 2**20 <= need <= 93 * 2**20  # the default model's Q4_1 layers and Q8_0 head
    assert with_copy.runtime["decode_step"] == "one C call per decode step"
    monkeypatch.setattr(cpu_decode, "available_memory", lambda: 2 * need - 1)
    without = _runner(smol, True, cpu_matmul="int8")
    step = without.model.cpu_step
    assert step.repacked_bytes == 0 and step.model.all_packed == 0
    assert step.layers[0].qkv.wp is None and step.model.head.wp is None
    assert "without repacked weights" in without.runtime["decode_step"]
    assert "more than half the memory available" in step.repack_skipped
    g = torch.Generator().manual_seed(11)
    prompts = {f"s{i}": torch.randint(100, 40000, (6 + i,), generator=g).tolist() for i in range(9)}
    for a, b in zip(_decode(with_copy, prompts, 3), _decode(without, prompts, 3), strict=True):
        assert torch.equal(a, b)
    monkeypatch.setattr(cpu_decode, "available_memory", lambda: 2 * need)
    assert _runner(smol, True, cpu_matmul="int8").model.cpu_step.model.all_packed == 1


def test_k_quant_model_runs_in_the_step(lib, tmp_path, monkeypatch) -> None:
    """Q4_K / Q5_K / Q6_K weights (hidden 256: whole super-blocks) keep their raw rows, dequantize
    as gguf does, and decode in the one-call step close to the float32 weights. Their
    linears get the repacked copy: a stream's logits are the same bits decoded alone and
    beside an 80-token prompt chunk (81 rows: two passes over the copy), and the same bits
    as an engine's without copies (the original blocks, interleaved rows)."""
    from gguf.quants import dequantize

    from kvserve.workers.model import cpu_decode

    hf = make_tiny_hf_model(tmp_path / "k", "llama", seed=8, with_tokenizer=False, hidden_size=256,
                            intermediate_size=512, num_attention_heads=8, num_key_value_heads=2)
    for qt in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        path = write_gguf(tmp_path / f"{qt.name}.gguf", hf, qt)
        loaded = load_model(path)
        name = "model.layers.0.mlp.down_proj.weight"
        q = loaded.quantized[name]
        assert q.qtype == qt.name and q.shape == (256, 512)
        assert torch.equal(loaded.weights[name], torch.from_numpy(dequantize(q.data.numpy(), qt)))
        _assert_int8_close(loaded, 4, 0.05)
        r = _runner(loaded, True, cpu_matmul="int8")
        layer = r.model.cpu_step.layers[0]
        assert all(getattr(layer, f).wp for f in ("qkv", "o", "gate_up", "down"))
        g = torch.Generator().manual_seed(9)
        toks = torch.randint(100, 40000, (12,), generator=g).tolist()
        forced = [[(13 * i + 5) % 30000 + 100] for i in range(3)]
        alone = _decode(r, {"t": toks}, 3, forced)
        chunk = torch.randint(100, 40000, (80,), generator=g).tolist()
        with monkeypatch.context() as mp:
            mp.setattr(cpu_decode, "PACKED_QTYPES", ())
            r0 = _runner(loaded, True, cpu_matmul="int8")
        assert not r0.model.cpu_step.layers[0].down.wp and r0.model.cpu_step.model.all_packed == 0
        seen = []
        for runner in (r, r0):
            runner.execute([StreamStep("t", toks, len(toks))])
            steps = [StreamStep("t", [*toks, forced[0][0]], len(toks) + 1), StreamStep("p", chunk, 80)]
            seen.append(runner.execute(steps)[1])
        assert torch.equal(seen[0][0], alone[0][0])
        assert torch.equal(seen[0], seen[1])


@pytest.mark.parametrize("tied", [True, False])
def test_int8_model_holds_the_blocks_not_float_weights(lib, tmp_path, tied: bool) -> None:
    """A quantized GGUF's linears get no float32 weight in an int8 model (the kernel reads
    the blocks; a 7-8B Q4_K_M file's float32 expansion would not fit in memory beside them),
    and their logits are the bits of a model built from every float weight made up front.
    The loader defers those weights (made, equal to transformers', when read); the embedding
    is looked up by rows and made at once; an `exact` model makes the linears' weights for
    the batches it leaves to MKL."""
    from kvserve.workers.loading.loader import LoadedModel, ModelWeights

    hf = make_tiny_hf_model(tmp_path / "m", "llama", seed=4, with_tokenizer=False, hidden_size=256,
                            intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                            tie_word_embeddings=tied)
    loaded = load_model(write_gguf(tmp_path / "m.gguf", hf, Q.Q4_K))
    w = loaded.weights
    assert isinstance(w, ModelWeights)
    q = "model.layers.0.self_attn.q_proj.weight"  # rows permuted back from llama.cpp's order
    assert w.held(q).is_meta and w.held(q).shape == loaded.quantized[q].shape
    assert not w[q].is_meta and torch.equal(w[q], w[q])
    assert not w.held("model.embed_tokens.weight").is_meta
    assert ("lm_head.weight" in w) is not tied

    def linears(runner: ModelRunner) -> list:
        m = runner.model
        return [m.lm_head, *(lin for ly in m.layers
                             for lin in (ly.attn.qkv, ly.attn.o, ly.mlp.gate_up, ly.mlp.down))]

    lazy = _runner(loaded, True, cpu_matmul="int8")
    assert all(lin.weight.is_meta and lin.int8 for lin in linears(lazy))
    eager = LoadedModel(config=loaded.config, weights=dict(w), path=loaded.path, quantized=loaded.quantized)
    assert not any(t.is_meta for t in eager.weights.values())
    made = _runner(eager, True, cpu_matmul="int8")
    prompts = _prompts(3, torch.Generator().manual_seed(4))
    for runner in (lazy, made):
        runner.model.cpu_step = None  # op by op: every linear through Linear.__call__
    for g, e in zip(_decode(lazy, prompts, 2), _decode(made, prompts, 2), strict=True):
        assert torch.equal(g, e)
    exact = _runner(loaded, False, cpu_matmul="exact")
    for lin, ref in zip(linears(exact), linears(made), strict=True):
        assert not lin.weight.is_meta and lin.weight.shape == ref.weight.shape


@pytest.mark.parametrize(("main", "fallback", "other"), [(Q.Q4_K, Q.Q5_0, Q.IQ4_NL), (Q.Q5_K, Q.Q5_1, Q.Q5_1),
                                                       (Q.Q3_K, Q.IQ4_NL, Q.Q4_K)],
                         ids=["Q4_K_M", "Q5_K_M", "Q3_K_M"])
def test_k_quant_mixes_of_small_models_run_in_the_step(lib, tmp_path, main: Q, fallback: Q, other: Q) -> None:
    """A file mixed as llama.cpp's Q4_K_M / Q5_K_M / Q3_K_M mix small models: the K-quant
    where K is a multiple of 256, its fallback (Q5_0, Q5_1 or IQ4_NL) where it is not (down,
    K = 288), another type for o, Q6_K for the embedding and for v in every other layer
    (beside q and k of the K-quant: the fused q|k|v keeps its parts apart). IQ4_NL loads as
    Q8_0 blocks of the same values, Q3_K as Q6_K ones, Q5_0, Q5_1 and Q5_K as they are, so
    the whole model decodes in the one-call step (each linear, each part, with its repacked
    copy): the op-by-op forward's bits, close to the float32 weights."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    hf = make_tiny_hf_model(tmp_path / "m", "llama", seed=8, with_tokenizer=False, hidden_size=256,
                            intermediate_size=288, num_attention_heads=8, num_key_value_heads=2)

    def mix(name: str, array) -> Q:
        if name == "token_embd.weight" or (name.endswith("attn_v.weight") and name.startswith("blk.0.")):
            return Q.Q6_K
        if name.endswith("attn_output.weight"):
            return other
        return main if array.shape[1] % 256 == 0 else fallback

    path = write_gguf(tmp_path / "mix.gguf", hf, mix)
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    loaded = load_model(path)
    def kept(qt: Q) -> Q:  # the type the loader keeps the blocks in
        return {Q.IQ4_NL: Q.Q8_0, Q.Q3_K: Q.Q6_K}.get(qt, qt)

    for gguf_name, hf_name, qt in (("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight", fallback),
                                   ("blk.1.attn_output.weight", "model.layers.1.self_attn.o_proj.weight", other),
                                   ("blk.1.ffn_gate.weight", "model.layers.1.mlp.gate_proj.weight", main)):
        t = tensors[gguf_name]
        assert t.tensor_type == qt
        q = loaded.quantized[hf_name]
        assert q.qtype == kept(qt).name
        want = dequantize(t.data, qt)
        assert torch.equal(torch.from_numpy(dequantize(q.data.numpy(), kept(qt))), torch.from_numpy(want))
        assert torch.equal(loaded.weights[hf_name], torch.from_numpy(want))
    _assert_int8_close(loaded, 4, 0.05)
    r = _runner(loaded, True, cpu_matmul="int8")
    qkv = r.model.layers[0].attn.qkv
    if kept(main) == Q.Q6_K:  # q, k and v of one type: fused
        assert qkv.parts is None and qkv.quant.qtype == "Q6_K"
    else:
        assert qkv.quant is None and [q.qtype for q in qkv.parts] == [main.name, main.name, "Q6_K"]
    assert r.model.layers[1].attn.qkv.parts is None and r.model.layers[1].attn.qkv.quant.qtype == kept(main).name
    for i in (0, 1):
        layer = r.model.cpu_step.layers[i]
        assert all(getattr(layer, f).wp for f in ("qkv", "o", "gate_up", "down"))
    if kept(main) != Q.Q6_K:
        assert r.model.cpu_step.layers[0].qkv.n_parts == 3 and all(r.model.cpu_step.layers[0].qkv.parts[j].wp
                                                                   for j in range(3))
    assert r.model.cpu_step.model.head.wp and r.model.cpu_step.model.all_packed
    prompts = _prompts(3, torch.Generator().manual_seed(5))
    got = _decode(r, prompts, 4)
    want = _decode(_runner(loaded, False, cpu_matmul="int8"), prompts, 4)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_lora_engine_decodes_op_by_op(lib, smol) -> None:
    """The one-call step reads the base weights' blocks only: with LoRA adapters possible,
    decode steps run op by op (through the adapted linears), and the runtime says so."""
    r = ModelRunner(smol, EngineConfig(kv_cache_tokens=1024, enable_prefix_caching=False,
                                       host_cache_gib=0, enable_lora=True))
    assert r.runtime["decode_step"] == "op by op: LoRA adapters run op by op", r.runtime
    prompts = _prompts(2, torch.Generator().manual_seed(5))
    got = _decode(r, prompts, 2)  # no adapter requested: the base model's logits
    ref = _decode(_runner(smol, True), prompts, 2)
    for g, w in zip(got, ref, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=0)


@pytest.mark.parametrize("act", [0, 1], ids=["silu", "gelu_tanh"])
def test_mlp_activation_gives_the_same_bits_at_every_width(lib, act: int) -> None:
    """The MLP's activation (the step's and the op-by-op forward's, `ds_act_rows`) runs 16
    lanes wide on AVX-512 hosts, 8 on AVX2 ones, the rest of a row one by one: the 256-bit
    build gives the same bits (on an AVX2 host both builds are that one), over widths that
    end in each part, signed zeros and gates far past exp's range; and the values are torch's."""
    narrow = require_kernel("decode_step", load_decode_step(("-DKV_NO_W512", "-DQG_NO_W512")))
    g = torch.Generator().manual_seed(act)
    for n in (16, 24, 91):
        gu = torch.randn(5, 2 * n, generator=g) * 6
        gu[0, :8] = torch.tensor([0.0, -0.0, -100.0, 100.0, -87.0, -88.0, 1e-30, -1e-30])
        outs = []
        for b in (lib, narrow):
            out = torch.full((5, n), float("nan"))
            b.ds_act_rows(gu.data_ptr(), 5, n, gu.stride(0), out.data_ptr(), act, 2)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]), n
        gate, up = gu[:, :n], gu[:, n:]
        f = torch.nn.functional
        want = (f.silu(gate) if act == 0 else f.gelu(gate, approximate="tanh")) * up
        torch.testing.assert_close(outs[0], want, atol=1e-5, rtol=1e-5)


def test_the_steps_float16_cache_writes_round_as_torch(lib) -> None:
    """The one-call step writes K/V into a float16 cache rounded to nearest even, as the
    op-by-op forward's torch writes round: F16C and the portable build's scalar code alike,
    over ties, subnormals, values past float16's range, infinities and NaN."""
    portable = require_kernel("decode_step", load_decode_step(("-mno-avx2",)))
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(4000, generator=g) * s for s in (1e-6, 1e-3, 1.0, 300.0, 3e4)])
    edge = [0.0, -0.0, 65504.0, 65519.0, 65520.0, -70000.0, 2.0**-24, 2.0**-25, 3 * 2.0**-26,
            6.1e-5, 1 + 2.0**-11, 1 + 3 * 2.0**-11, float("inf"), -float("inf")]
    x = torch.cat([x, torch.tensor(edge), torch.zeros(2)])  # a multiple of 8
    want = x.half().view(torch.int16)
    for build in (lib, portable):
        out = torch.zeros(len(x), dtype=torch.int16)
        build.ds_kv_half(x.data_ptr(), len(x), out.data_ptr())
        assert torch.equal(out, want)
    nan = torch.full((8,), float("nan"))
    for build in (lib, portable):
        out = torch.zeros(8, dtype=torch.float16)
        build.ds_kv_half(nan.data_ptr(), 8, out.data_ptr())
        assert out.isnan().all()


@pytest.mark.parametrize("arch", ["default", "gemma2", "mistral"])
def test_float16_cache_step_is_op_by_op_bit_for_bit(lib, smol, family_models, arch: str) -> None:
    """With a float16 KV cache (kv_cache_dtype) the one-call step gives the op-by-op
    forward's bits in both matmul modes, past the windows and with soft-caps; and with float32
    activations its logits stay near the float32 cache's (float16's rounding, 2^-11)."""
    loaded = smol if arch == "default" else load_model(family_models[arch])
    prompts = _prompts(3, torch.Generator().manual_seed(12))
    steps = 20
    got = {}
    for mode in ("exact", "int8"):
        fused = _runner(loaded, True, cpu_matmul=mode, kv_cache_dtype="float16")
        assert fused.cache.kv.dtype == torch.float16 and fused.runtime["kv_cache_dtype"] == "float16"
        got[mode] = _decode(fused, prompts, steps)
        want = _decode(_runner(loaded, False, cpu_matmul=mode, kv_cache_dtype="float16"), prompts, steps)
        for g, w in zip(got[mode], want, strict=True):
            assert torch.equal(g, w), mode
    ref = _decode(_runner(loaded, True, cpu_matmul="exact"), prompts, steps)
    for g, r in zip(got["exact"], ref, strict=True):
        assert ((g - r).norm(dim=-1) <= 0.005 * r.norm(dim=-1) + 1e-3).all()
