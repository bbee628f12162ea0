"""Slot and Leases: a router slot is released exactly once, whoever releases it first."""

from __future__ import annotations

from typing import Any

from kvserve.deploy.slots import Leases, Slot


class _Calls:
    """Records `.remote(...)` calls of an actor method (the router's, the worker's)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def remote(self, *args: Any) -> None:
        self.calls.append(args)


class _Actor:
    def __init__(self) -> None:
        self.release, self.abort = _Calls(), _Calls()


def _slot(router: _Actor, live: dict, rid: str = "r1", n: int = 0) -> Slot:
    pick = {"idx": 1, "worker_id": "worker-1", "slot_id": f"{rid}@{n}", "epoch": "e"}
    return Slot(router, pick, rid, live)


def test_release_is_idempotent_and_aborts_unfinished_requests():
    router, worker, live = _Actor(), _Actor(), {}
    s = _slot(router, live)
    s.worker = worker
    assert live == {"r1@0": s}
    assert s.release() and not s.release() and not s.release()
    assert router.release.calls == [(1, "r1@0")]
    assert worker.abort.calls == [("r1",)]
    assert live == {}


def test_a_finished_request_is_not_aborted():
    router, worker, live = _Actor(), _Actor(), {}
    s = _slot(router, live)
    s.worker, s.finished = worker, True
    s.release()
    assert router.release.calls == [(1, "r1@0")] and worker.abort.calls == []


def test_leases_release_every_slot_once_and_late_slots_at_once():
    router, live = _Actor(), {}
    leases = Leases()
    a, b = _slot(router, live, "a"), _slot(router, live, "b")
    leases.add(a)
    leases.add(b)
    a.release()  # the stream's own finally came first
    assert leases.close() == 1  # only b was still held
    assert leases.close() == 0
    late = _slot(router, live, "c")
    leases.add(late)  # a pick that returned after the client left
    assert late.released
    assert sorted(c[1] for c in router.release.calls) == ["a@0", "b@0", "c@0"]
    assert live == {}


def test_a_stream_whose_send_fails_gives_its_slots_back_without_gc():
    """The leak's mechanism: after a client disconnect, Serve's `send` raises; Starlette then
    abandons the body iterator at a `yield`, and the generators' `finally` would run only when
    the cyclic garbage collector gets to them. The response's own `finally` releases at once."""
    import asyncio
    import gc

    from kvserve.deploy.openai_api import LeasedStreamingResponse

    router, live = _Actor(), {}
    leases = Leases()

    async def body():
        slot = _slot(router, live)
        leases.add(slot)
        try:
            for i in range(100):
                await asyncio.sleep(0)
                yield f"data: {i}\n\n"
        finally:
            slot.release()

    async def run() -> None:
        sent = 0

        async def send(msg: dict) -> None:
            nonlocal sent
            sent += msg["type"] == "http.response.body"
            if sent > 3:
                raise RuntimeError("New messages cannot be sent after the queue is closed.")

        async def receive() -> dict:
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        resp = LeasedStreamingResponse(body(), leases, media_type="text/event-stream")
        try:
            await resp({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
        except BaseException:  # Starlette re-raises the send error (in a group)
            pass
        assert router.release.calls == [(1, "r1@0")], "released only by the garbage collector"

    gc.disable()
    try:
        asyncio.run(run())
    finally:
        gc.enable()


def test_releases_are_not_children_of_the_request_that_sends_them():
    """Ray cancels, recursively, the actor calls a cancelled request submitted; it finds the
    submitter in `ray._raylet.async_task_id`. A release (and abort) sent from a cancelled
    request's `finally` must not count as its child, or Ray cancels it before it runs."""
    from ray import _raylet

    seen: list[Any] = []

    class _Recording(_Calls):
        def remote(self, *args: Any) -> None:
            seen.append(_raylet.async_task_id.get())
            super().remote(*args)

    router, worker = _Actor(), _Actor()
    router.release, worker.abort = _Recording(), _Recording()
    token = _raylet.async_task_id.set("the-request's-task")
    try:
        s = _slot(router, {})
        s.worker = worker
        s.release()
    finally:
        _raylet.async_task_id.reset(token)
    assert seen == [None, None]
    assert router.release.calls == [(1, "r1@0")] and worker.abort.calls == [("r1",)]
