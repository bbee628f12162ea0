"""The fused small-op kernels (RoPE + K/V store, residual add + RMSNorm, SiLU-and-mul)
against the plain torch ops they replace; on the CPU through Triton's interpreter."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # CPU: Triton's interpreter, set before the kernels compile
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is in the test extra")

from kvserve.workers.model.triton_fused import add_rms_norm, rope_cache, silu_mul  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _rope_ref(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 16), (9, 3, 64), (6, 6, 8)])
def test_rope_cache_rotates_and_stores(dtype, hq, hkv, d) -> None:
    g = torch.Generator().manual_seed(hq * 100 + d)
    t, max_pos, blocks, bs = 7, 64, 6, 4
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(DEVICE, dtype)
    ang = torch.randn(max_pos, d // 2, generator=g)
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(DEVICE, dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(DEVICE, dtype)
    pos = torch.tensor([0, 5, 63, 17, 2, 2, 40], device=DEVICE)
    slots = torch.tensor([3, 22, 0, 9, 14, 15, 7], device=DEVICE)  # scattered, any order
    kc = torch.full((blocks, bs, hkv, d), float("nan"), device=DEVICE, dtype=dtype)
    vc = kc.clone()
    before = qkv.clone()
    q = rope_cache(qkv, pos, cos, sin, kc, vc, slots, hq, hkv, d)
    x = before.float()
    c, s = cos.float()[pos].unsqueeze(1), sin.float()[pos].unsqueeze(1)
    want_q = _rope_ref(x[:, : hq * d].view(t, hq, d), c, s)
    want_k = _rope_ref(x[:, hq * d : (hq + hkv) * d].view(t, hkv, d), c, s)
    want_v = x[:, (hq + hkv) * d :].view(t, hkv, d)
    assert q.shape == (t, hq, d) and q.data_ptr() == qkv.data_ptr()  # a view: rotated in place
    torch.testing.assert_close(q.float(), want_q, **TOL[dtype])
    flat_k, flat_v = kc.view(-1, hkv, d), vc.view(-1, hkv, d)
    torch.testing.assert_close(flat_k[slots].float(), want_k, **TOL[dtype])
    torch.testing.assert_close(flat_v[slots].float(), want_v, **TOL[dtype])
    others = torch.ones(blocks * bs, dtype=torch.bool)
    others[slots.cpu()] = False
    assert flat_k[others.to(DEVICE)].isnan().all()  # nothing written outside the slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [64, 576, 100])
def test_add_rms_norm(dtype, n) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(5, n, generator=g).to(DEVICE, dtype)
    res = torch.randn(5, n, generator=g).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(DEVICE, dtype)

    def ref(v):
        v = v.float()
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()

    torch.testing.assert_close(add_rms_norm(x, w, 1e-5).float(), ref(x), **TOL[dtype])
    total = (x.float() + res.float()).to(dtype)
    out = add_rms_norm(x, w, 1e-5, residual=res)
    # updated in place, rounded once (within one bfloat16 step: the interpreter may truncate)
    torch.testing.assert_close(res, total, atol=0, rtol=0 if dtype == torch.float32 else 2**-7)
    torch.testing.assert_close(out.float(), ref(total), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype) -> None:
    g = torch.Generator().manual_seed(3)
    gu = torch.randn(4, 2 * 1536, generator=g).to(DEVICE, dtype)
    gate, up = gu.float().chunk(2, -1)
    torch.testing.assert_close(silu_mul(gu).float(), torch.nn.functional.silu(gate) * up, **TOL[dtype])


def test_fused_model_matches_unfused(tmp_path_factory) -> None:
    """The whole tiny model through the fused kernels gives the unfused path's greedy tokens
    (prefill chunks, mixed steps and decode)."""
    from tiny_models import tiny_model_path

    from kvserve import LLM, SamplingParams

    path = tiny_model_path(tmp_path_factory)
    prompts = [[100 + (7 * i + j) % 900 for j in range(n)] for i, n in enumerate([3, 21, 9, 14])]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for fused in (False, True):
        llm = LLM(path, attention_backend="triton", block_size=4, kv_cache_tokens=256,
                  max_num_batched_tokens=16, device=DEVICE, dtype="float32")
        llm.engine.runner.model.fused = fused
        outs[fused] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs[True] == outs[False]


def test_fused_family_matches_unfused(tmp_path_factory) -> None:
    """Gemma 3 through the Triton kernels, fused where its ops fit (q/k norms applied in place
    before the fused RoPE, (1 + w) norms and post-norms, the local and global RoPE tables;
    GeGLU stays in torch), gives the unfused greedy tokens, with a prompt past its window."""
    from arch_models import make_arch_model

    from kvserve import LLM, SamplingParams

    path = make_arch_model(tmp_path_factory.mktemp("gemma3") / "m", "gemma3", seed=5)
    prompts = [[100 + (7 * i + j) % 900 for j in range(n)] for i, n in enumerate([3, 21])]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = {}
    for fused in (False, True):
        llm = LLM(path, attention_backend="triton", block_size=4, kv_cache_tokens=256,
                  max_num_batched_tokens=16, device=DEVICE, dtype="float32")
        llm.engine.runner.model.fused = fused
        outs[fused] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs[True] == outs[False]
