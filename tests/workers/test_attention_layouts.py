"""TorchAttention writes SDPA outputs of any memory layout.

CUDA's memory-efficient SDPA returns its [1, H, L, D] output as a transposed view of a
[1, L, H, D] buffer; the CPU kernels return it contiguous. The test makes SDPA return
that CUDA layout on the CPU, so the decode path's output write is checked here too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.kvcache.device_cache import DeviceKVCache
from kvserve.workers.model.attention import AttentionMetadata
from kvserve.workers.model.attention_torch import TorchAttention

_sdpa = F.scaled_dot_product_attention


def _cuda_layout_sdpa(*args, **kwargs) -> torch.Tensor:
    o = _sdpa(*args, **kwargs)
    return o.transpose(1, 2).contiguous().transpose(1, 2)  # [1, L, H, D] storage


def _step(hq: int, hkv: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    d, bs = 16, 4
    cache = DeviceKVCache(1, 8, bs, hkv, d, torch.float32, "cpu")
    cache.kv.normal_(generator=g)
    # stream 0 decodes its 7th token (context 6, scattered blocks); stream 1 prefills 3
    meta = AttentionMetadata(query_lens=[1, 3], context_lens=[6, 0], block_tables=[[5, 2], [0]],
                             slot_mapping=torch.tensor([5 * bs + 2, 0, 1, 2]), block_size=bs)
    q = torch.randn(4, hq, d, generator=g)
    k = torch.randn(4, hkv, d, generator=g)
    v = torch.randn(4, hkv, d, generator=g)
    attn = TorchAttention(use_kernel=False)
    attn.prepare(meta, torch.device("cpu"))
    out = attn.forward(0, q, k, v, cache, meta)
    # plain softmax reference for the decode row
    kc, vc = cache.layer(0)
    ks = kc[[5, 2]].reshape(-1, hkv, d)[:7].repeat_interleave(hq // hkv, 1)
    vs = vc[[5, 2]].reshape(-1, hkv, d)[:7].repeat_interleave(hq // hkv, 1)
    att = torch.softmax(torch.einsum("hd,thd->ht", q[0], ks) * d**-0.5, -1)
    return out[0], torch.einsum("ht,thd->hd", att, vs)


@pytest.mark.parametrize("hq,hkv", [(6, 2), (4, 4), (4, 1)])
def test_decode_output_with_cuda_sdpa_layout(monkeypatch, hq, hkv) -> None:
    monkeypatch.setattr(F, "scaled_dot_product_attention", _cuda_layout_sdpa)
    got, want = _step(hq, hkv)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_prompt_rows_through_the_kernel_match_sdpa() -> None:
    """prefill_rows (the 8-bit path): a prompt chunk after cached context, beside a decode
    row, attends row by row through the C kernel to SDPA's values."""
    from c_kernels import require_kernel

    from kvserve.workers.model.cpu_kernels import load_paged_decode

    require_kernel("paged_decode", load_paged_decode())
    g = torch.Generator().manual_seed(1)
    hq, hkv, d, bs = 6, 2, 32, 4
    cache = DeviceKVCache(1, 8, bs, hkv, d, torch.float32, "cpu")
    cache.kv.normal_(generator=g)
    # stream 0 decodes its 7th token; stream 1 prefills positions 5..9 after 5 cached
    meta = AttentionMetadata(query_lens=[1, 5], context_lens=[6, 5], block_tables=[[5, 2], [0, 3, 4]],
                             slot_mapping=torch.tensor([5 * bs + 2, 3 * bs + 1, 3 * bs + 2, 3 * bs + 3,
                                                        4 * bs, 4 * bs + 1]), block_size=bs)
    q, k, v = (torch.randn(6, h, d, generator=g) for h in (hq, hkv, hkv))
    outs = []
    for rows in (False, True):
        attn = TorchAttention(use_kernel=True, prefill_rows=rows)
        assert attn.prefill_rows is rows
        attn.prepare(meta, torch.device("cpu"))
        outs.append(attn.forward(0, q, k, v, cache, meta))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
