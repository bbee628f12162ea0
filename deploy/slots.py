"""Router slots: a request's place in a worker's in-flight count, given back exactly once.

The router counts a request against its worker from `pick` until `release`. Every path
out of a request (answered, failed, worker died, client gone before the pick returned,
between chunks or while a chunk was on its way) must release it once, at once: a count
left behind skews routing for good and, with `max_inflight_per_worker`, ends in refusing
everything. Release is therefore a plain synchronous call on an idempotent object, made
by the stream's own `finally` and, independently, by the front end when its response ends
(`Leases.close`), so it never waits for an abandoned generator to be garbage-collected.
The router also drops duplicate releases by slot id.
"""

from __future__ import annotations

import contextvars
from typing import Any


def outside_request() -> contextvars.Context:
    """A context whose Ray actor calls are not children of the request being served.

    When Serve cancels a request (client gone), Ray cancels, recursively, every task the
    request submitted. A `router.release` sent from the request's `finally` would be
    cancelled before it runs, and a `router.pick` in flight would fail with
    TaskCancelledError though the router counted it: both lose the release for good. Ray
    finds the submitting task of an async actor's call in a context variable; clear it."""
    ctx = contextvars.copy_context()
    try:
        from ray import _raylet
    except ImportError:  # no Ray (unit tests of this module): nothing to detach from
        return ctx
    var = getattr(_raylet, "async_task_id", None)
    if var is not None:
        ctx.run(var.set, None)
    return ctx


class Slot:
    """One routed attempt of one request: its worker index and the router's slot id."""

    __slots__ = ("router", "idx", "worker_id", "slot_id", "request_id", "epoch", "worker",
                 "finished", "released", "_live", "handoff_to", "prefill_worker_id",
                 "decode_worker_id")

    def __init__(self, router: Any, pick: dict[str, Any], request_id: str,
                 live: dict[str, Slot]) -> None:
        self.router = router
        self.idx: int = pick["idx"]
        self.worker_id: str = pick["worker_id"]
        self.slot_id: str = pick["slot_id"]
        self.epoch: str = pick["epoch"]
        # disaggregated serving: the decode worker the stream is handed to after its first
        # token (None: it decodes where it starts); where the prompt runs and where it decodes
        self.handoff_to: int | None = pick.get("handoff_to")
        self.prefill_worker_id: str = pick["worker_id"]
        self.decode_worker_id: str = pick.get("handoff_worker_id") or pick["worker_id"]
        self.request_id = request_id
        self.worker: Any = None  # set once the stream starts on it (abort needs it)
        self.finished = False  # the worker ended the request itself: nothing to abort
        self.released = False
        self._live = live
        live[self.slot_id] = self

    def release(self) -> bool:
        """Give the slot back (and abort the request on its worker if it still runs).
        Only the first call does anything; returns whether this one did."""
        if self.released:
            return False
        self.released = True
        self._live.pop(self.slot_id, None)
        ctx = outside_request()  # not cancelled with the request that sends them
        ctx.run(self.router.release.remote, self.idx, self.slot_id)
        if not self.finished and self.worker is not None:
            ctx.run(self.worker.abort.remote, self.request_id)  # frees its KV now
        return True


class Leases:
    """The slots of one client request (its `n` choices and their retries).

    The front end closes it on every exit path of the request; a slot added after the
    close (a pick that returned after the client left) is released on the spot.
    """

    def __init__(self) -> None:
        self._slots: list[Slot] = []
        self.closed = False

    def add(self, slot: Slot) -> None:
        if self.closed:
            slot.release()
        else:
            self._slots.append(slot)

    def close(self) -> int:
        """Release every slot still held; returns how many this call released."""
        self.closed = True
        slots, self._slots = self._slots, []
        return sum(s.release() for s in slots)

