"""The engine's steady decode step at batch B on CUDA (LLMEngine.step: scheduling, forward,
sampling, detokenization): ms per step, then a cProfile of 30 steps.
Usage: python scripts/gpu/profile_engine.py MODEL_DIR BATCH"""
import cProfile
import pstats
import sys
import time

import torch

from kvserve.config import EngineConfig
from kvserve.sampling import SamplingParams
from kvserve.workers.engine.engine import LLMEngine

path, B = sys.argv[1], int(sys.argv[2])
eng = LLMEngine(EngineConfig(model=path, max_num_seqs=B, kv_cache_tokens=B * 700,
                             max_num_batched_tokens=8192))
g = torch.Generator().manual_seed(0)
p = SamplingParams(max_tokens=400, min_tokens=400, temperature=0.0, ignore_eos=True)
for _ in range(B):
    eng.add_request(torch.randint(100, 40000, (256,), generator=g).tolist(), p)
for _ in range(40):  # past every prefill
    eng.step()
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(50):
    eng.step()
print(f"engine B={B}: {(time.perf_counter() - t) / 50 * 1e3:.3f} ms/step decode")
pr = cProfile.Profile()
pr.enable()
for _ in range(30):
    eng.step()
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(22)
