"""The LoRA shrink/expand kernels against the torch product they replace (on the CPU through
Triton's interpreter): rows of several adapters of different ranks and of the base in one
launch, slots with capacity beyond each rank (never read), and a whole engine whose LoRA
linears take the kernel path giving the torch path's greedy tokens."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # CPU: Triton's interpreter, set before the kernels compile
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is in the test extra")

from kvserve.workers.model.triton_lora import lora_expand, lora_shrink  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n", [(64, 192), (200, 70)])
def test_shrink_expand_per_row_adapters(dtype, k, n) -> None:
    g = torch.Generator().manual_seed(k + n)
    slots, cap = 4, 48
    ranks = torch.tensor([8, 0, 33, 48], dtype=torch.int32)  # slot 1: its adapter skips this linear
    a = torch.randn(slots, cap, k, generator=g) * 0.3
    b = torch.randn(slots, cap, n, generator=g) * 0.3
    for s in range(slots):  # past a slot's rank: garbage the kernels must not read
        a[s, ranks[s]:] = float("nan")
        b[s, ranks[s]:] = float("nan")
    token_slots = torch.tensor([-1, 0, 0, 2, 3, -1, 1, 2, 0, 3, 3], dtype=torch.int32)
    t_rows = len(token_slots)
    x = torch.randn(t_rows, k, generator=g)
    base = torch.randn(t_rows, n, generator=g)
    want = base.clone()
    for i, s in enumerate(token_slots.tolist()):
        if s >= 0 and ranks[s] > 0:
            r = int(ranks[s])
            want[i] += (x[i].to(dtype).float() @ a[s, :r].to(dtype).float().T) @ b[s, :r].to(dtype).float()
    dev = dict(device=DEVICE)
    out = base.to(dtype=dtype, **dev)
    t = lora_shrink(x.to(dtype=dtype, **dev), a.to(dtype=dtype, **dev), ranks.to(**dev),
                    token_slots.to(**dev))
    lora_expand(t, b.to(dtype=dtype, **dev), ranks.to(**dev), token_slots.to(**dev), out)
    torch.testing.assert_close(out.float().cpu(), want.to(dtype).float(), **TOL[dtype])
    base_rows = (token_slots < 0) | (token_slots == 1)
    assert torch.equal(out.cpu()[base_rows], base.to(dtype)[base_rows])  # untouched


# the whole engine under the Triton interpreter takes tens of seconds on the CPU: the slow
# tier (the kernels themselves are checked above, in the default tier)
@pytest.mark.slow
def test_engine_on_the_kernel_path_gives_the_torch_paths_tokens(tmp_path_factory) -> None:
    from lora_adapters import make_adapter
    from tiny_models import tiny_model_path

    from kvserve import LLM, SamplingParams

    base = tiny_model_path(tmp_path_factory)
    root = tmp_path_factory.mktemp("triton_loras")
    loras = {"a": make_adapter(base, str(root / "a"), 4, seed=11),
             "b": make_adapter(base, str(root / "b"), 12, seed=12, targets=["v_proj", "up_proj"])}
    prompts = [[5, 17, 300, 42, 99, 1000, 7], [9] * 11]
    names = [None, "a", "b"]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    got = {}
    for kernels in (False, True):
        llm = LLM(base, block_size=4, num_threads=1, kv_cache_tokens=1024, host_cache_gib=0,
                  loras=loras, max_loras=2)
        llm.engine.runner.lora.kernels = kernels  # the CUDA path's switch, taken on the CPU
        outs = llm.generate([p for p in prompts for _ in names], sp,
                            lora=[n for _ in prompts for n in names])
        got[kernels] = [o.token_ids for o in outs]
    assert got[True] == got[False]
