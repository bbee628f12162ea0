"""Where a decode step's time goes on CUDA: the runner's graph-replayed decode step split
into reserve / launch / argmax+sync (host timers, medians of 30 steps), build_step alone,
and a torch-profiler table of an eager step's kernels.
Usage: python scripts/gpu/profile_step.py MODEL_DIR BATCH CONTEXT"""
import sys
import time

import torch

from kvserve.config import EngineConfig
from kvserve.kvcache.manager import StreamStep
from kvserve.workers.loading.loader import load_model
from kvserve.workers.model.runner import DTYPES, ModelRunner
from kvserve.workers.model.step_inputs import build_step

path, B, ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cfg = EngineConfig(model=path, kv_cache_tokens=B * (ctx + 64) + 1024, max_num_seqs=max(B, 1),
                   max_num_batched_tokens=8192, enable_prefix_caching=False)
runner = ModelRunner(load_model(path, DTYPES[cfg.resolved_dtype()]), cfg)
g = torch.Generator().manual_seed(0)
toks = {f"s{i}": torch.randint(100, 40000, (ctx,), generator=g).tolist() for i in range(B)}
pending = list(toks)
while pending:
    steps, left = [], 8192
    for s in pending:
        n = min(ctx - runner.kv.num_computed(s), left)
        if n <= 0:
            break
        steps.append(StreamStep(s, toks[s], runner.kv.num_computed(s) + n))
        left -= n
    runner.execute(steps)
    pending = [s for s in pending if runner.kv.num_computed(s) < ctx]


def step(split=None):
    t0 = time.perf_counter()
    steps = [StreamStep(s, t + [t[-1]], len(t) + 1) for s, t in toks.items()]
    plan = runner.kv.reserve(steps)
    t1 = time.perf_counter()
    logits = runner.run(plan)
    t2 = time.perf_counter()
    nxt = logits.argmax(-1).tolist()
    t3 = time.perf_counter()
    for t, n in zip(toks.values(), nxt, strict=False):
        t.append(n)
    if split is not None:
        split.append((t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t0))


for _ in range(5):
    step()
split = []
for _ in range(30):
    step(split)
med = [sorted(c)[len(c) // 2] * 1e3 for c in zip(*split, strict=False)]
print(f"B={B} ctx={ctx} graphs={runner.graphs is not None}: ms/step reserve {med[0]:.3f} "
      f"run(launch) {med[1]:.3f} argmax+sync {med[2]:.3f} total {med[3]:.3f}")
# host-side build cost alone
steps = [StreamStep(s, t + [t[-1]], len(t) + 1) for s, t in toks.items()]
plan = runner.kv.reserve(steps)
t0 = time.perf_counter()
for _ in range(20):
    build_step(plan, runner.block_size, runner.max_model_len)
print(f"build_step {1e3 * (time.perf_counter() - t0) / 20:.3f} ms")
runner.kv.rollback(plan)
graphs = runner.graphs
runner.graphs = None  # eager, profiled
for _ in range(3):
    step()
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
runner.graphs = graphs
