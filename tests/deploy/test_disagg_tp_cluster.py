"""Prefill and decode workers of different tensor-parallel sizes through real Ray (CPU gloo):
a router of its own whose worker-0 spans two ranks and worker-1 one, on a tiny Llama with
two KV heads, driven through the ingress's Service. A long prompt prefilled on the size-2
worker decodes on the size-1 worker, and the other way once the router re-roles them; the
tokens are the single-device engine's, the decode worker computes none of the prompt, and
nothing stays reserved or held.

The hand-off carries whole KV heads (the size-2 worker's host tier gathers its ranks'
halves), so the sizes need not match."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from serve_fixtures import ray_started
from tiny_models import make_tiny_hf_model

from kvserve import LLM, SamplingParams
from kvserve.deploy.config import ServeConfig
from kvserve.deploy.service import Result, Service
from kvserve.router.config import RouterConfig
from kvserve.router.router import RouterActor

pytestmark = pytest.mark.slow  # a router and a tensor-parallel worker of its own

ENGINE = {"num_threads": 1, "kv_cache_tokens": 1024, "max_model_len": 256, "max_num_seqs": 8,
          "dtype": "float32", "host_cache_gib": 0.01}
MAX_TOKENS = 12
# one prompt per direction: neither worker has the other's in its prefix cache
PROMPTS = {d: f"{d}: The history of the printing press begins in the fifteenth century, when "
              "a goldsmith in Mainz combined several existing techniques into one workshop"
           for d in ("2 to 1", "1 to 2")}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_tiny_hf_model(tmp_path_factory.mktemp("disagg_tp"), "llama", seed=5,
                              num_key_value_heads=2)


@pytest.fixture(scope="module")
def want(model) -> dict[str, list[int]]:
    """Each prompt's greedy tokens on one single-device engine."""
    llm = LLM(model, kv_cache_tokens=1024, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = {d: llm.generate(p, params)[0].token_ids for d, p in PROMPTS.items()}
    del llm  # (its engine's memory, before the cluster starts)
    gc.collect()
    return out


@pytest.fixture(scope="module")
def cluster(model) -> Iterator[Any]:
    own = not ray.is_initialized()
    if own:
        ray_started(lambda: ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False))
    cfg = RouterConfig(num_workers=2, engine={**ENGINE, "model": model},
                       num_cpus_per_worker=0.5, load_poll_interval_s=0.5,
                       migration={"enabled": False}, roles=["prefill", "decode"],
                       role_engine={"prefill": {"tensor_parallel_size": 2}},
                       disagg={"min_prompt_tokens": 8})
    router = ray.remote(RouterActor).options(num_cpus=0, max_concurrency=1000).remote(
        cfg.to_dict())
    ray.get(router.ready.remote())
    try:
        yield router
    finally:
        ray.get(router.stop_workers.remote())  # (their placement groups would outlive it)
        ray.kill(router)
        if own:
            ray.shutdown()


@pytest.fixture(scope="module")
def svc(cluster, model) -> Service:
    s = Service(ServeConfig(model=model, prefill_workers=1, decode_workers=1,
                            prefill_tensor_parallel_size=2, num_cpus_per_worker=0.5,
                            engine=ENGINE), router=cluster)
    asyncio.run(s.start())
    return s


def _wait_clean(cluster: Any) -> None:
    deadline = time.monotonic() + 60
    while True:
        handles = ray.get(cluster.workers.remote())
        state = [(ray.get(h.load.remote())["stats"]["kv_blocks_used"],
                  ray.get(h.handoffs.remote()), ray.get(h.live_moves.remote())) for h in handles]
        if all(used == 0 and held == {"prefilling": [], "held": []}
               and moves == {"out": [], "in": []} for used, held, moves in state):
            return
        assert time.monotonic() < deadline, state
        time.sleep(0.25)


@pytest.mark.parametrize("direction", ["2 to 1", "1 to 2"])
def test_a_prompt_prefilled_at_one_size_decodes_at_another(cluster, svc, want, direction):
    roles = ["prefill", "decode"] if direction == "2 to 1" else ["decode", "prefill"]
    ray.get(cluster.set_roles.remote(roles))
    info = ray.get(cluster.server_info.remote())
    sizes = {w["role"]: w["tensor_parallel_size"] for w in info["workers"]}
    assert sizes == ({"prefill": 2, "decode": 1} if direction == "2 to 1"
                     else {"prefill": 1, "decode": 2})
    pre, dec = roles.index("prefill"), roles.index("decode")
    handles = ray.get(cluster.workers.remote())
    before = ray.get(handles[dec].load.remote())["stats"]
    logged = len(ray.get(cluster.handoff_log.remote()))

    async def run() -> Result:
        return await svc.complete(svc.build(
            svc.tokenize(prompt=PROMPTS[direction]),
            {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}, None, None))

    r = asyncio.run(run())
    assert r.token_ids == want[direction]
    assert (r.prefill_worker_id, r.worker_id) == (f"worker-{pre}", f"worker-{dec}")
    deadline = time.monotonic() + 30
    while len(log := ray.get(cluster.handoff_log.remote())) == logged:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    (entry,) = log[logged:]
    assert entry["outcome"] == "moved" and entry["bytes"] > 0, entry
    _wait_clean(cluster)
    after = ray.get(handles[dec].load.remote())["stats"]
    assert after["tokens_computed"] - before["tokens_computed"] == MAX_TOKENS - 1
    assert after["tokens_recomputed"] == before["tokens_recomputed"]
