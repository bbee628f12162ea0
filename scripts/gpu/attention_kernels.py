"""One layer of decode attention on the Llama-3.2-1B shape (32/8 heads, head dim 64, block
size 16, bf16): dense SDPA over an unpaged copy of the keys against the Triton paged kernel
with each key-split count. Usage: python scripts/gpu/attention_kernels.py (CUDA)."""
import torch
import triton

from kvserve.workers.model.triton_paged_attention import paged_attention

hq, hkv, d, bs = 32, 8, 64, 16
for B, ctx in [(1, 512), (64, 512), (256, 512), (64, 2048)]:
    nblk = B * (ctx // bs + 1) + 1
    kc = torch.randn(nblk, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    perm = torch.randperm(nblk - 1, device="cuda")[: B * (ctx // bs + 1)].view(B, -1)
    q = torch.randn(B, hq, d, device="cuda", dtype=torch.bfloat16)
    ar = torch.arange(B, device="cuda")
    tiles = torch.stack([ar, ar, torch.ones_like(ar), torch.full_like(ar, ctx - 1)])
    # reference: SDPA over the same keys gathered dense
    kd = kc[perm].flatten(1, 2)[:, :ctx].transpose(1, 2)
    vd = vc[perm].flatten(1, 2)[:, :ctx].transpose(1, 2)
    ref = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, enable_gqa=True).squeeze(2)
    t_sdpa = triton.testing.do_bench(lambda q=q, kd=kd, vd=vd: torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), kd, vd, enable_gqa=True), return_mode="median")
    kv_gb = 2 * B * ctx * hkv * d * 2 / 1e9
    print(f"B={B} ctx={ctx}: dense SDPA {t_sdpa*1e3:.1f} us ({kv_gb/t_sdpa*1e3:.0f} GB/s)")
    for sp in (None, 1, 2, 4, 8, 16):
        o = paged_attention(q, kc, vc, perm, tiles, 1, splits=sp)
        err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
        t = triton.testing.do_bench(
            lambda q=q, kc=kc, vc=vc, perm=perm, tiles=tiles, sp=sp: paged_attention(
                q, kc, vc, perm, tiles, 1, splits=sp), return_mode="median")
        print(f"  splits={sp}: {t*1e3:7.1f} us ({kv_gb/t*1e3:5.0f} GB/s) err {err:.1e}")
