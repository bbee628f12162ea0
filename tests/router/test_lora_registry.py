"""The router's LoRA registry (no Ray: workers are fakes of one class): a load goes to every
worker or none, an unload to all, and a worker that comes back without the adapters loaded
since the start (a restart) gets them again after a poll."""

from __future__ import annotations

import asyncio
from typing import Any

from kvserve.router.loras import LoraRegistry
from kvserve.router.policy import WorkerView


class _Remote:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class FakeWorker:
    def __init__(self, refuse: set[str] = frozenset()) -> None:
        self.loaded: dict[str, str] = {}
        self.refuse = set(refuse)

        async def add(name: str, source: str) -> dict[str, Any]:
            if source in self.refuse:
                return {"error": f"LoRA adapter {source}: rank 64 is above max_lora_rank 16",
                        "kind": "invalid"}
            self.loaded[name] = source
            return {"name": name, "source": source, "rank": 8, "modules": ["q_proj"],
                    "root": 123}

        async def remove(name: str) -> dict[str, Any]:
            if self.loaded.pop(name, None) is None:
                return {"error": "not loaded", "kind": "not_found"}
            return {"removed": name}

        self.add_lora, self.remove_lora = _Remote(add), _Remote(remove)


def _setup(workers: list[FakeWorker]) -> tuple[LoraRegistry, list[WorkerView]]:
    views = [WorkerView(i, f"worker-{i}", alive=True) for i in range(len(workers))]
    reg = LoraRegistry(workers, views)
    reg.started([{"loras": []} for _ in workers])  # the configuration: no adapters
    return reg, views


def test_load_is_all_or_none_and_unload_reaches_every_worker():
    good, bad = FakeWorker(), FakeWorker(refuse={"/big"})
    reg, views = _setup([good, bad])

    async def run() -> None:
        res = await reg.load("big", "/big", [0, 1])
        assert res["kind"] == "invalid" and "max_lora_rank" in res["error"]
        assert good.loaded == {} and bad.loaded == {} and "big" not in reg.known
        res = await reg.load("sql", "/sql", [0, 1])
        assert res["rank"] == 8 and res["root"] == 123
        assert good.loaded == bad.loaded == {"sql": "/sql"}
        assert all("sql" in v.loras for v in views)
        res = await reg.load("sql", "/other", [0, 1])
        assert res["kind"] == "invalid" and "already loaded" in res["error"]
        assert good.loaded == {"sql": "/sql"}
        assert (await reg.unload("sql", [0, 1])) == {"removed": "sql"}
        assert good.loaded == bad.loaded == {} and reg.listing() == []
        assert (await reg.unload("sql", [0, 1]))["kind"] == "not_found"

    asyncio.run(run())


def test_a_router_not_yet_ready_leaves_the_workers_adapters_alone():
    w = FakeWorker()
    w.loaded = {"sql": "/sql"}  # the configuration's, loaded at the worker's start
    w.list_loras = _Remote(lambda: _listing(w))
    views = [WorkerView(0, "worker-0", alive=True, loras={"sql"})]
    reg = LoraRegistry([w], views)

    async def run() -> None:
        reg.check(views[0])  # a poll before `ready`: nothing is unloaded
        await asyncio.sleep(0.05)
        assert w.loaded == {"sql": "/sql"}
        await reg.learn(0)  # a pick naming an adapter before `ready`
        assert set(reg.known) == {"sql"} and reg.initialized

    asyncio.run(run())


async def _listing(w: FakeWorker) -> list[dict[str, Any]]:
    return [{"name": n, "source": s, "rank": 8, "modules": ["q_proj"], "root": 1,
             "where": "host"} for n, s in w.loaded.items()]


def test_a_restarted_worker_gets_its_adapters_back_after_a_poll():
    a, b = FakeWorker(), FakeWorker()
    reg, views = _setup([a, b])

    async def run() -> None:
        await reg.load("sql", "/sql", [0, 1])
        await reg.load("chat", "/chat", [0, 1])
        await reg.unload("chat", [0, 1])
        # worker 1 restarted: it knows nothing; its poll says so
        b.loaded.clear()
        b.loaded["stale"] = "/stale"  # and one the registry no longer serves
        views[1].loras = set(b.loaded)
        reg.check(views[1])
        reg.check(views[1])  # a second poll while the first resync runs starts none
        for _ in range(100):
            await asyncio.sleep(0.01)
            if b.loaded == {"sql": "/sql"}:
                break
        assert b.loaded == {"sql": "/sql"} and views[1].loras == {"sql"}
        reg.check(views[0])  # a worker in line: nothing to do
        assert not reg._syncing

    asyncio.run(run())

    # until a worker's poll shows the adapter back, requests naming it go to the others
    def idx(vs: list[WorkerView]) -> list[int]:
        return [v.idx for v in vs]

    assert idx(reg.holders(views, "sql")) == [0, 1]
    views[1].loras = set()
    assert idx(reg.holders(views, "sql")) == [0]
    views[0].loras = set()
    assert idx(reg.holders(views, "sql")) == [0, 1]  # none has it: not narrowed
