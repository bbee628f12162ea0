"""The exact quantized small-batch linear (csrc/qgemv.c, float32 activations) against gguf's
dequantization, and the engine with it against the dequantized float32 weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from c_kernels import require_kernel
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from tiny_models import make_tiny_hf_model

from kvserve.config import EngineConfig
from kvserve.kvcache.manager import StreamStep
from kvserve.workers.loading.loader import load_model
from kvserve.workers.loading.quant_format import EXACT_QTYPES, QuantizedWeight, concat_rows
from kvserve.workers.model.cpu_kernels import load_qgemv
from kvserve.workers.model.quant_linear import qlinear
from kvserve.workers.model.runner import ModelRunner


@pytest.fixture(scope="module")
def lib():
    return require_kernel("qgemv", load_qgemv())


def random_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw ggml rows [n, k/32 * block bytes] with random scales and quants."""
    nb = n * k // 32
    d = (rng.standard_normal(nb) * 0.05).astype(np.float16).view(np.uint8).reshape(nb, 2)
    parts = [d]
    if qtype == "Q4_1":
        parts.append((rng.standard_normal(nb) * 0.2).astype(np.float16).view(np.uint8).reshape(nb, 2))
    nq = 32 if qtype == "Q8_0" else 16
    parts.append(rng.integers(0, 256, (nb, nq), dtype=np.uint8))
    return np.concatenate(parts, axis=1).reshape(n, -1)


@pytest.mark.parametrize("qtype", EXACT_QTYPES)
@pytest.mark.parametrize("m", [1, 3, 8, 11, 17])
def test_kernel_matches_gguf_dequantize(lib, qtype: str, m: int) -> None:
    rng = np.random.default_rng([*qtype.encode(), m])
    n, k = 37, 160  # odd rows; 5 blocks per row
    raw = random_blocks(qtype, n, k, rng)
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType[qtype]).astype(np.float32))
    qw = QuantizedWeight(qtype, torch.from_numpy(raw), (n, k))
    # identity rows read the dequantized weights back: they must be gguf's, bit for bit
    assert torch.equal(qlinear(torch.eye(k), qw, lib).T, ref)
    x = torch.randn(m, k)
    # the sums differ from MKL's only in order: bound by a few ulps of sum |x * w|
    err = (qlinear(x, qw, lib) - F.linear(x, ref)).abs()
    assert (err <= 1e-5 * (x.abs() @ ref.abs().T) + 1e-6).all()


def test_concat_rows_requires_matching_parts() -> None:
    a = QuantizedWeight("Q4_1", torch.zeros(4, 20, dtype=torch.uint8), (4, 32))
    b = QuantizedWeight("Q4_1", torch.ones(2, 20, dtype=torch.uint8), (2, 32))
    c = QuantizedWeight("Q8_0", torch.zeros(2, 34, dtype=torch.uint8), (2, 32))
    fused = concat_rows([a, b])
    assert fused is not None and fused.shape == (6, 32) and fused.data[4:].eq(1).all()
    assert concat_rows([a, c]) is None
    assert concat_rows([a, None]) is None


@pytest.fixture(scope="module")
def loaded(smol_path):
    return load_model(smol_path)


def test_default_model_raw_rows_dequantize_exactly(lib, loaded) -> None:
    assert loaded.quantized["model.embed_tokens.weight"].qtype == "Q8_0"
    names = [n for n in loaded.quantized if n.startswith("model.layers.0.")]
    assert len(names) == 7  # q, k (un-permuted like the float rows), v, o, gate, up, down
    for name in [*names, "model.embed_tokens.weight"]:
        qw = loaded.quantized[name]
        rows = min(qw.shape[0], 2048)
        part = QuantizedWeight(qw.qtype, qw.data[:rows], (rows, qw.shape[1]))
        got = qlinear(torch.eye(qw.shape[1]), part, lib).T
        assert torch.equal(got, loaded.weights[name][:rows]), name


def _runner(loaded, on: bool) -> ModelRunner:
    return ModelRunner(loaded, EngineConfig(kv_cache_tokens=1024, quantized_decode=on,
                                            cpu_matmul="exact", host_cache_gib=0))


def _greedy(runner: ModelRunner, sid: str, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    toks = list(prompt)
    logits_seen = []
    for _ in range(n):
        _, logits = runner.execute([StreamStep(sid, toks, len(toks))])
        logits_seen.append(logits[0])
        toks.append(int(logits[0].argmax()))
    runner.free(sid)
    return toks[len(prompt):], logits_seen


def _decode(runner: ModelRunner, prompts: dict[str, list[int]], n: int) -> tuple[dict, list]:
    """Greedy-decode all streams together for n steps: generated ids and per-step logits."""
    toks = {s: list(p) for s, p in prompts.items()}
    seen = []
    for _ in range(n):
        _, logits = runner.execute([StreamStep(s, t, len(t)) for s, t in toks.items()])
        seen.append(logits)
        for t, nxt in zip(toks.values(), logits.argmax(-1).tolist(), strict=True):
            t.append(nxt)
    for s in toks:
        runner.free(s)
    return {s: t[len(prompts[s]):] for s, t in toks.items()}, seen


@pytest.mark.parametrize(
    "prompts",
    [
        {"a": [1, 504, 3458, 282, 4649, 314, 30, 2, 198]},  # one stream: 1-row linears
        {"b": list(range(1000, 1040)), "c": [9226] * 20, "d": list(range(300, 317))},
    ],
    ids=["single", "three-streams"],
)
def test_default_model_decode_on_matches_off(lib, loaded, prompts) -> None:
    on, off = _runner(loaded, True), _runner(loaded, False)
    assert on.model.layers[0].attn.qkv.quant is not None and on.model.lm_head.quant is not None
    assert off.model.layers[0].attn.qkv.quant is None
    got, got_logits = _decode(on, prompts, 32)
    want, want_logits = _decode(off, prompts, 32)
    assert got == want
    for g, w in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(g, w, atol=1e-3, rtol=0)


def test_hf_model_without_raw_rows_uses_fp32(tmp_path) -> None:
    loaded = load_model(make_tiny_hf_model(tmp_path / "tiny", with_tokenizer=False))
    assert loaded.quantized == {}
    runner = _runner(loaded, True)
    assert all(layer.attn.qkv.quant is None for layer in runner.model.layers)
    _, logits = runner.execute([StreamStep("a", [5, 6, 7], 3)])
    assert logits.shape == (1, loaded.config.vocab_size) and torch.isfinite(logits).all()
