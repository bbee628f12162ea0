"""The router's disaggregation choices (router/disagg.py) on views it would poll, with worker
handles that answer `live_reserve` (a unit test of the class: no Ray): prefill worker by KV
affinity then load, decode worker by room, session and load; local prefill for short
prompts, prefix hits, no prefill worker or no room; a reservation refused sends the
request to the next decode worker. Role lists and KV descriptions that cannot serve are
refused, and so are role settings in ServeConfig and `kvserve serve`."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvserve.deploy.config import ServeConfig
from kvserve.router.disagg import Disagg, DisaggConfig, check_exchange, check_roles
from kvserve.router.policy import WorkerView, make_policy

KV = {"model": {"architecture": "llama", "num_layers": 2}, "dtype": "float32", "block_size": 16}


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class _Handle:
    """Answers `live_reserve` (room or not) and records it; the hand-off's own calls are
    not made here (the test cancels the hand-off tasks)."""

    def __init__(self, room: bool = True) -> None:
        self.room = room
        self.reserved: list[str] = []
        self.live_reserve = _Method(self._reserve)
        self.live_cancel = _Method(self._async(True))
        self.handoff_freeze = _Method(lambda *a: (self._never(), None))

    async def _reserve(self, info: dict, growth: int, lease: float) -> dict:
        if not self.room:
            return {"error": "no room for the stream", "refused": True}
        self.reserved.append(info["request_id"])
        return {"blocks": 5}

    @staticmethod
    def _async(value: Any) -> Any:
        async def f(*args: Any) -> Any:
            return value
        return f

    @staticmethod
    async def _never() -> dict:
        await asyncio.sleep(3600)
        return {}


def _views(free: list[int]) -> list[WorkerView]:
    return [WorkerView(i, f"worker-{i}", alive=True, kv_blocks_free=f, kv_blocks_total=256)
            for i, f in enumerate(free)]


def _disagg(roles: list[str], free: list[int], room: list[bool] | None = None,
            **cfg: Any) -> tuple[Disagg, list[WorkerView], list[_Handle]]:
    views = _views(free)
    handles = [_Handle(r) for r in (room or [True] * len(roles))]
    d = Disagg(DisaggConfig(**cfg), roles, handles, views)
    d.kv = {i: KV for i in range(len(roles))}
    return d, views, handles


def _choose(d: Disagg, views: list[WorkerView], hashes: list[int] | None = None,
            session: int | None = None, prompt: int = 512, rid: str = "r") -> Any:
    async def run() -> Any:
        c = await d.choose(views, make_policy("affinity", 4), hashes or [], session, rid,
                           prompt, 64, prompt + 64, 4)
        for t in list(d.tasks.values()):  # the hand-offs themselves are not under test
            t.cancel()
            await asyncio.gather(t, return_exceptions=True)
        return c

    return asyncio.run(run())


def test_long_prompts_go_to_a_prefill_worker_and_the_decode_worker_reserves():
    d, views, handles = _disagg(["prefill", "prefill", "decode", "decode"], [200, 200, 50, 120])
    views[0].inflight = 3  # the least loaded prefill worker
    c = _choose(d, views)
    assert (c.idx, c.handoff_to, c.reason) == (1, 3, "disaggregated")  # the roomier decode
    assert handles[3].reserved == ["r"] and not handles[2].reserved
    assert d.pending["r"][:2] == (3, 5)  # counted against its room until a poll sees it
    d.observe(3, float("inf"))
    assert "r" not in d.pending


def test_kv_affinity_among_prefill_workers_then_load():
    d, views, _ = _disagg(["prefill", "prefill", "decode"], [200, 200, 200])
    hashes = [11, 12, 13, 14]
    views[1].held_device = {11, 12}
    views[1].inflight = 2
    c = _choose(d, views, hashes)
    assert c.idx == 1 and c.matched_blocks == 2 and c.handoff_to == 2


def test_short_prompts_and_prefix_hits_are_prefilled_where_they_decode():
    d, views, handles = _disagg(["prefill", "decode"], [200, 200], min_prompt_tokens=256)
    c = _choose(d, views, prompt=100)
    assert (c.idx, c.handoff_to, c.reason) == (1, None, "local_short_prompt")
    hashes = list(range(32))  # 512 tokens, 20 blocks of them cached on the decode worker
    views[1].held_host = set(hashes[:20])
    c = _choose(d, views, hashes)
    assert (c.idx, c.handoff_to, c.reason) == (1, None, "local_prefix_hit")
    views[1].held_host = set(hashes[:10])  # 160 of 512: not most of it
    assert _choose(d, views, hashes).handoff_to == 1
    assert not handles[1].reserved[:-1]  # only the last one reserved
    assert d.local == {"short_prompt": 1, "prefix_hit": 1}


def test_a_session_goes_back_to_its_decode_worker():
    d, views, _ = _disagg(["prefill", "decode", "decode"], [200, 200, 220])
    c = _choose(d, views, session=1)
    assert c.handoff_to == 1 and c.session_idx == 1
    views[1].inflight = 10  # beyond the imbalance bound: it gives way
    assert _choose(d, views, session=1, rid="r2").handoff_to == 2


def test_no_room_anywhere_queues_on_the_least_loaded_decode_worker():
    d, views, handles = _disagg(["prefill", "decode", "decode"], [200, 2, 3])
    views[2].inflight = 1
    c = _choose(d, views)
    assert (c.idx, c.handoff_to, c.reason) == (1, None, "local_no_room")
    assert not handles[1].reserved and not handles[2].reserved


def test_a_refused_reservation_tries_the_next_decode_worker_then_prefills_locally():
    d, views, handles = _disagg(["prefill", "decode", "decode"], [200, 200, 100],
                                room=[True, False, True])
    assert _choose(d, views).handoff_to == 2  # worker 1's poll was stale
    d, views, handles = _disagg(["prefill", "decode"], [200, 200], room=[True, False])
    c = _choose(d, views)
    assert (c.idx, c.handoff_to, c.reason) == (1, None, "local_no_room")


def test_without_prefill_or_decode_workers_left_a_request_is_still_served():
    d, views, _ = _disagg(["prefill", "decode"], [200, 200])
    assert _choose(d, [views[1]]).reason == "local_no_prefill_worker"
    c = _choose(d, [views[0]])  # its decode worker is down: the prefill worker serves it
    assert (c.idx, c.handoff_to, c.reason) == (0, None, "local_no_decode_worker")


@pytest.mark.parametrize("roles, why", [
    (["prefill"], "at least one decode worker"),
    (["decode", "decode"], "at least one prefill worker"),
    (["prefill", "decode", "mixed"], "cannot be combined"),
    (["prefill", "reader"], "not one of"),
])
def test_role_lists_that_cannot_serve_are_refused(roles, why):
    with pytest.raises(ValueError, match=why):
        check_roles(roles)
    check_roles(["mixed", "mixed"])
    check_roles(["prefill", "decode", "decode"])


@pytest.mark.parametrize("other, why", [
    ({**KV, "block_size": 32}, "KV block size 16 vs 32"),
    ({**KV, "dtype": "bfloat16"}, "KV dtype float32 vs bfloat16"),
    ({**KV, "model": {"architecture": "qwen2", "num_layers": 2}}, "cannot exchange KV: model"),
])
def test_workers_whose_kv_cannot_be_exchanged_are_named(other, why):
    roles = ["prefill", "decode"]
    assert check_exchange({0: KV, 1: dict(KV)}, roles) is None
    msg = check_exchange({0: KV, 1: other}, roles)
    assert msg is not None and why in msg and "worker-0 (prefill) and worker-1 (decode)" in msg
    assert check_exchange({0: KV, 1: other}, ["mixed", "mixed"]) is None


def test_serve_config_roles():
    c = ServeConfig(prefill_workers=1, decode_workers=2, prefill_tensor_parallel_size=2,
                    disagg_min_prompt_tokens=64, disagg_failure_policy="fail")
    assert c.num_workers == 0 and c.total_workers == 3 and c.roles() == ["prefill", "decode",
                                                                       "decode"]
    r = c.router_config()
    assert r.num_workers == 3 and r.roles == c.roles()
    assert r.role_engine == {"prefill": {"tensor_parallel_size": 2}}
    assert r.engine_of(0, {})["tensor_parallel_size"] == 2
    assert "tensor_parallel_size" not in r.engine_of(1, {})
    assert r.disagg["min_prompt_tokens"] == 64 and r.disagg["failure_policy"] == "fail"
    # a round trip (the ingress gets the config this way) names the same router
    again = ServeConfig.model_validate(c.model_dump())
    assert again.router_config().digest() == r.digest()
    assert ServeConfig().roles() == [] and ServeConfig().router_config().roles == []


@pytest.mark.parametrize("settings, why", [
    ({"prefill_workers": 1}, "prefill_workers (--prefill-workers) needs decode_workers"),
    ({"decode_workers": 2}, "decode_workers (--decode-workers) needs prefill_workers"),
    ({"prefill_workers": 1, "decode_workers": 1, "num_workers": 2}, "cannot be combined"),
    ({"prefill_tensor_parallel_size": 2}, "needs prefill_workers and decode_workers"),
    ({"prefill_workers": 1, "decode_workers": 1, "prefill_gpus_per_worker": 1},
     "prefill workers run on GPUs (bfloat16 KV) and decode workers on the CPU"),
    ({"prefill_workers": 1, "decode_workers": 1, "decode_tensor_parallel_size": 2,
      "decode_gpus_per_worker": 1}, "decode_gpus_per_worker must be 2"),
    ({"prefill_workers": 1, "decode_workers": 1, "disagg_failure_policy": "retry"},
     "disagg_failure_policy"),
    ({"num_workers": 0}, "must be at least 1"),
])
def test_bad_role_settings_are_refused(settings, why):
    with pytest.raises(ValueError, match=why.replace("(", "\\(").replace(")", "\\)")):
        ServeConfig(**settings)


def test_one_dtype_lets_gpu_and_cpu_roles_exchange_kv():
    ServeConfig(prefill_workers=1, decode_workers=1, prefill_gpus_per_worker=1,
                engine={"dtype": "float32"})


@pytest.mark.parametrize("argv, why", [
    (["--prefill-workers", "1"], "needs decode_workers"),
    (["--prefill-workers", "1", "--decode-workers", "1", "--workers", "2"], "cannot be combined"),
    (["--disagg-min-prompt-tokens", "64"], "need --prefill-workers and --decode-workers"),
    (["--decode-tensor-parallel-size", "2"], "needs prefill_workers and decode_workers"),
])
def test_serve_refuses_bad_role_flags(argv, why):
    import argparse

    from kvserve.deploy.serve_cli import add_serve_parser, config_from_args
    from kvserve.errors import ConfigError

    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers())
    with pytest.raises(ConfigError, match=why):
        config_from_args(p.parse_args(["serve", *argv]))


def test_serve_flags_reach_the_config():
    import argparse

    from kvserve.deploy.serve_cli import add_serve_parser, config_from_args

    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers())
    c = config_from_args(p.parse_args(["serve", "--prefill-workers", "2", "--decode-workers", "1",
                                       "--decode-tensor-parallel-size", "2",
                                       "--disagg-min-prompt-tokens", "128",
                                       "--disagg-failure-policy", "fail"]))
    assert (c.prefill_workers, c.decode_workers, c.num_workers) == (2, 1, 0)
    assert c.decode_tensor_parallel_size == 2 and c.disagg_min_prompt_tokens == 128
    assert c.disagg_failure_policy == "fail"
    assert config_from_args(p.parse_args(["serve"])).num_workers == 1


def test_serve_refuses_a_role_size_the_model_cannot_split_before_ray_starts(capsys):
    import sys

    from kvserve.cli import main

    ray_was_up = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    # the default model has 9 attention heads: 3 splits them, 2 does not
    assert main(["serve", "--prefill-workers", "1", "--decode-workers", "1",
                 "--prefill-tensor-parallel-size", "3", "--decode-tensor-parallel-size", "2",
                 "--gpus-per-worker", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvserve: error: ") and "\n" not in err
    assert "tensor_parallel_size 2 does not divide the model's 9 attention heads" in err
    assert ray_was_up == ("ray" in sys.modules and sys.modules["ray"].is_initialized())
