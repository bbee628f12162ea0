"""The fused-MoE Triton kernels against a per-token reference; on the CPU through Triton's
interpreter: uneven expert loads, an expert no token picks, top-1 and top-2, both tile
heights, float32 and bfloat16; and a Mixture-of-Experts model whose layers run them."""

from __future__ import annotations

import os
import random

import torch

if not torch.cuda.is_available():  # CPU: Triton's interpreter, set before the kernels compile
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is in the test extra")

from kvserve.workers.model.triton_moe import align, fused_moe  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
E, H, F = 6, 64, 48  # F below the kernel's column tile: masked columns


def reference(x, w13, w2, weights, ids):
    """Token by token, expert by expert, in float64."""
    x, w13, w2, weights = (a.double().cpu() for a in (x, w13, w2, weights))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            gate, up = (w13[e] @ x[t]).split(F)
            out[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def _routing(t: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert 0 takes most tokens, expert 3 none, the others a few each."""
    rng = random.Random(t * 10 + k)
    used = [0, 1, 2, 4, 5]
    ids = []
    for _ in range(t):
        first = 0 if rng.random() < 0.7 else rng.choice(used[1:])
        ids.append([first, *rng.sample([e for e in used if e != first], k - 1)])
    weights = torch.softmax(torch.randn(t, k, generator=g), dim=-1)
    return weights, torch.tensor(ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,k,block_m", [(1, 1, None), (1, 2, None), (19, 1, None), (19, 2, 16),
                                         (19, 2, 64)])
def test_fused_moe_matches_reference(dtype, t, k, block_m) -> None:
    g = torch.Generator().manual_seed(t * 10 + k)
    x = torch.randn(t, H, generator=g)
    w13 = torch.randn(E, 2 * F, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, F, generator=g) / F**0.5
    weights, ids = _routing(t, k, g)
    assert (ids == 3).sum() == 0  # an expert with no tokens
    want = reference(x.to(dtype), w13.to(dtype), w2.to(dtype), weights.to(dtype), ids)
    got = fused_moe(*(a.to(DEVICE, dtype) for a in (x, w13, w2, weights)), ids.to(DEVICE),
                    block_m=block_m)
    assert got.shape == (t, H) and got.dtype == dtype
    torch.testing.assert_close(got.double().cpu(), want, **TOL[dtype])


def test_align_groups_pairs_by_expert_in_padded_tiles() -> None:
    ids = torch.tensor([[0, 2], [2, 5], [0, 2], [5, 0], [2, 1]], device=DEVICE)  # no expert 3, 4
    bm = 4
    sorted_ids, tile_expert, total = align(ids, E, bm)
    n = ids.numel()
    counts = [3, 1, 4, 0, 0, 2]  # experts' pair counts: padded to 4, 4, 4, 0, 0, 4
    assert int(total) == 16 and sorted_ids.numel() % bm == 0
    assert sorted_ids.numel() >= n + E * (bm - 1)  # room for any routing's padding
    flat = ids.flatten().tolist()
    tiles = sorted_ids[:16].view(-1, bm).tolist()
    assert tile_expert[:4].tolist() == [0, 1, 2, 5]
    seen = []
    for tile, e in zip(tiles, tile_expert.tolist(), strict=False):
        real = [p for p in tile if p < n]
        assert all(flat[p] == e for p in real) and real == sorted(real)  # tokens in order
        assert len(real) == counts[e]
        seen += real
    assert sorted(seen) == list(range(n))  # every pair once
    assert (sorted_ids[16:] == n).all()  # the rest is padding


def test_model_through_the_fused_kernels_matches_grouped(tmp_path_factory, monkeypatch) -> None:
    """A tiny Qwen3-MoE (8 experts, top-2) with its MoE layers on the fused kernels (the path
    CUDA takes) gives the grouped torch path's greedy tokens over a mixed prefill and decode
    batch; the grouped path is checked against transformers in test_moe_models.py."""
    from moe_models import make_moe_model

    from kvserve import LLM, SamplingParams
    from kvserve.workers.model import triton_moe
    from kvserve.workers.model.layers.moe import SparseMoE

    path = make_moe_model(tmp_path_factory.mktemp("moe") / "m", "qwen3_moe", seed=3)
    prompts = [[100 + (7 * i + j) % 900 for j in range(n)] for i, n in enumerate([3, 21, 9])]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(path, block_size=4, kv_cache_tokens=256, max_num_batched_tokens=16, device=DEVICE,
              dtype="float32")
    moes = [layer.mlp for layer in llm.engine.runner.model.layers]
    assert all(isinstance(m, SparseMoE) for m in moes)
    calls = []
    monkeypatch.setattr(triton_moe, "fused_moe", lambda *a: calls.append(1) or fused_moe(*a))
    outs = {}
    for kernel in (False, True):
        for m in moes:
            m.kernel = kernel
        outs[kernel] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs[True] == outs[False]
    assert len(calls) >= 2 * len(moes)  # the fused run took the kernels, every MoE layer
