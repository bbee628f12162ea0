"""The ingress's token demultiplexer with fake workers (no Ray): batches sorted into the
right requests in order, a slow reader's chunks merged, a dead worker failing exactly its
own requests, a restarted worker subscribed to anew."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvserve.deploy.token_demux import TokenDemux
from kvserve.deploy.token_inbox import Inbox, merge


class FakeStream:
    """Stands for Ray's ObjectRefGenerator: yields awaitables of the items."""

    def __init__(self) -> None:
        self.items: asyncio.Queue = asyncio.Queue()

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> asyncio.Future:
        item = await self.items.get()
        if isinstance(item, BaseException):
            raise item
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(item)
        return fut


class Remote:
    def __init__(self, fn: Any) -> None:
        self.remote = fn


class FakeWorker:
    def __init__(self) -> None:
        self.streams: dict[str, FakeStream] = {}
        self.subscribe = Remote(self._subscribe)
        self.keys: dict[str, str] = {}  # request id -> the stream key it was started under

    def starter(self, request_id: str) -> Any:
        async def start(sub_id: str, key: str) -> bool:
            self.keys[request_id] = key
            return True
        return start

    def _subscribe(self, sub_id: str) -> FakeStream:
        s = self.streams[sub_id] = FakeStream()
        s.items.put_nowait({"subscribed": "inc-1"})
        return s

    def send(self, batch: dict[str, list[dict]]) -> None:
        """A batch by request id (one never started keeps its name: nobody reads it)."""
        batch = {self.keys.get(rid, rid): chunks for rid, chunks in batch.items()}
        for s in self.streams.values():
            s.items.put_nowait({"batch": batch})

    def die(self, error: BaseException) -> None:
        for s in self.streams.values():
            s.items.put_nowait(error)
        self.streams.clear()


def chunk(ids: list[int], finish: str | None = None) -> dict[str, Any]:
    return {"token_ids": ids, "text": "".join(f"<{i}>" for i in ids), "finish_reason": finish,
            "stop_reason": None, "usage": [3, 0, ids[-1]], "worker_id": "worker-0"}


async def collect(agen: Any, into: list[dict], gate: asyncio.Event | None = None) -> None:
    """Read every chunk; with `gate`, stop reading after the first until the gate opens."""
    async for c in agen:
        into.append(c)
        if gate is not None:
            await gate.wait()


async def until(cond: Any, timeout: float = 10.0) -> None:
    """Let the other tasks run until `cond()` holds (an observed state, not a guessed wait)."""
    await asyncio.wait_for(_until(cond), timeout)


async def _until(cond: Any) -> None:
    while not cond():
        await asyncio.sleep(0.001)


def test_batches_reach_their_requests_in_order_and_slow_readers_merge():
    async def run() -> tuple[list[dict], list[dict], dict]:
        w, demux = FakeWorker(), TokenDemux()
        a: list[dict] = []
        b: list[dict] = []
        gate = asyncio.Event()
        ta = asyncio.create_task(collect(demux.stream(0, w, "a", w.starter("a")), a))
        tb = asyncio.create_task(collect(demux.stream(0, w, "b", w.starter("b")), b, gate))
        await until(lambda: len(w.keys) == 2)
        assert len(w.streams) == 1  # both requests on one subscription
        w.send({"a": [chunk([1])], "b": [chunk([1])]})
        await until(lambda: len(a) == len(b) == 1)
        for n in range(2, 8):  # b's reader does not read these: they merge for it
            w.send({"a": [chunk([n])], "b": [chunk([n])], "gone": [chunk([n])]})
            await until(lambda n=n: len(a) == n)  # a's reader keeps up
        w.send({"a": [chunk([8], "length")], "b": [chunk([8], "length")]})
        await asyncio.wait_for(ta, 10)
        gate.set()
        await asyncio.wait_for(tb, 10)
        return a, b, demux.info()

    a, b, info = asyncio.run(run())
    for got in (a, b):
        assert [t for c in got for t in c["token_ids"]] == list(range(1, 9))
        assert "".join(c["text"] for c in got) == "".join(f"<{i}>" for i in range(1, 9))
        assert got[-1]["finish_reason"] == "length" and got[-1]["usage"] == [3, 0, 8]
    assert len(a) == 8 and [len(c["token_ids"]) for c in b] == [1, 7]  # the rest merged
    assert info == {"token_streams": 1, "token_batches": 8}


def test_a_dead_worker_fails_exactly_its_requests_and_is_subscribed_anew():
    class Gone(Exception):
        pass

    async def run() -> None:
        w0, w1, demux = FakeWorker(), FakeWorker(), TokenDemux()
        on0: list[dict] = []
        on1: list[dict] = []
        t0 = asyncio.create_task(collect(demux.stream(0, w0, "x", w0.starter("x")), on0))
        t1 = asyncio.create_task(collect(demux.stream(1, w1, "y", w1.starter("y")), on1))
        await until(lambda: "x" in w0.keys and "y" in w1.keys)
        w0.send({"x": [chunk([1])]})
        w1.send({"y": [chunk([1])]})
        await until(lambda: on0 and on1)
        w0.die(Gone("worker-0 died"))
        with pytest.raises(Gone):
            await asyncio.wait_for(t0, 5)
        assert [c["token_ids"] for c in on0] == [[1]]  # what came before the death, then the error
        w1.send({"y": [chunk([2], "stop")]})
        await asyncio.wait_for(t1, 5)
        assert [c["token_ids"] for c in on1] == [[1], [2]]
        # the next request on worker 0 subscribes to its restarted actor
        again: list[dict] = []
        t2 = asyncio.create_task(collect(demux.stream(0, w0, "z", w0.starter("z")), again))
        await until(lambda: "z" in w0.keys)
        w0.send({"z": [chunk([5], "stop")]})
        await asyncio.wait_for(t2, 5)
        assert again[0]["token_ids"] == [5]

    asyncio.run(run())


def test_a_worker_that_forgot_the_subscription_gets_a_new_one():
    async def run() -> None:
        w, demux = FakeWorker(), TokenDemux()
        subs: list[str] = []

        keys: list[str] = []

        async def start(sub_id: str, key: str) -> bool:
            subs.append(sub_id)
            keys.append(key)
            return len(subs) > 1  # the first answer: "no such subscription" (it restarted)

        got: list[dict] = []
        task = asyncio.create_task(collect(demux.stream(0, w, "r", start), got))
        await until(lambda: len(subs) == 2)
        assert subs[0] != subs[1]
        w.streams[subs[1]].items.put_nowait({"batch": {keys[1]: [chunk([4], "stop")]}})
        await asyncio.wait_for(task, 5)
        assert got[0]["token_ids"] == [4]

    asyncio.run(run())


def test_merge_and_end_markers():
    m = merge(chunk([1]) | {"logprobs": [-0.5], "top_logprobs": None},
              chunk([2]) | {"logprobs": [-0.25], "top_logprobs": None})
    assert m["token_ids"] == [1, 2] and m["logprobs"] == [-0.5, -0.25] and m["text"] == "<1><2>"
    assert m["top_logprobs"] is None  # not asked for: stays absent

    async def run() -> list[dict]:
        box = Inbox()
        box.put(chunk([1]))
        box.put({"end": True})  # the worker ended it without a last chunk (an abort)
        return [c async for c in box.chunks()]

    assert [c["token_ids"] for c in asyncio.run(run())] == [[1]]


def test_two_streams_of_one_request_id_keep_their_own_chunks():
    """A client may reuse a request id that is still running: the worker refuses the second
    stream, and that refusal must not end (or take the chunks of) the first."""
    async def run() -> tuple[list[dict], list[dict]]:
        w, demux = FakeWorker(), TokenDemux()
        keys: list[str] = []

        async def start(sub_id: str, key: str) -> bool:
            keys.append(key)
            return True

        first: list[dict] = []
        second: list[dict] = []
        t1 = asyncio.create_task(collect(demux.stream(0, w, "dup", start), first))
        await until(lambda: len(keys) == 1)
        w.send({keys[0]: [chunk([1])]})
        t2 = asyncio.create_task(collect(demux.stream(0, w, "dup", start), second))
        await until(lambda: len(keys) == 2)
        assert keys[0] != keys[1]
        w.send({keys[1]: [{"error": "invalid", "message": "request id 'dup' is in use"}]})
        await asyncio.wait_for(t2, 5)
        w.send({keys[0]: [chunk([2], "length")]})
        await asyncio.wait_for(t1, 5)
        return first, second

    first, second = asyncio.run(run())
    assert [t for c in first for t in c["token_ids"]] == [1, 2]
    assert first[-1]["finish_reason"] == "length"
    assert [c.get("error") for c in second] == ["invalid"]
