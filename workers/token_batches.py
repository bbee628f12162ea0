"""The worker's batched token path: one Ray stream per ingress replica, not one per request.

An ingress replica opens one long-lived `subscribe(sub_id)` streaming generator on each
worker it uses, then starts requests on it with small `start` / `start_resume` calls. Each
request's chunks are produced exactly as on the per-request path (`WorkerActor._chunks`:
pacing, coalescing, errors, `moved_to`) by a driver task that drops them into the
subscription's outbox; the subscription yields the whole outbox, {stream key: [chunks]},
as ONE Ray item: at most one per engine step (or pacing interval) per ingress replica,
whatever the number of streams. At 256 streams and a 3 ms GPU step the per-request path
needed about 85,000 Ray items a second; this one needs about 330.

Backpressure per request is what it was: a driver waits until its previous chunk has
left the worker (the item holding it was yielded, which Ray's generator backpressure
pauses while the ingress falls behind), and the steps produced meanwhile merge into the
next chunk. When the subscription ends (the ingress replica is gone or closed it), every
request started on it is aborted, which frees its KV.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import ray

log = logging.getLogger(__name__)

# Batches the worker may have yielded and the ingress not yet taken before the worker's
# yield waits (and every stream's steps merge meanwhile).
SUBSCRIPTION_BACKPRESSURE = 2
SETTLE_PASSES = 16


def is_last(chunk: dict[str, Any]) -> bool:
    """Whether a request's stream ends with this chunk (on this worker)."""
    return (chunk.get("finish_reason") is not None or "error" in chunk or "moved_to" in chunk
            or "end" in chunk)


class Subscription:
    """One ingress replica's outbox on this worker."""

    def __init__(self, sub_id: str) -> None:
        self.sub_id = sub_id
        self.outbox: dict[str, list[dict[str, Any]]] = {}
        self.shipped: asyncio.Future = asyncio.get_running_loop().create_future()
        self.ready = asyncio.Event()
        self.drivers: dict[str, asyncio.Task] = {}  # by stream key
        self.closed = False
        self.puts = 0

    async def settle(self) -> None:
        """Let the other streams of the same engine step (or of the batch just shipped) add
        their chunks: they wake in the same few event-loop passes, so wait until two pass
        without a new chunk (bounded)."""
        seen, quiet = self.puts, 0
        for _ in range(SETTLE_PASSES):
            await asyncio.sleep(0)
            if self.puts != seen:
                seen, quiet = self.puts, 0
            elif (quiet := quiet + 1) >= 2:
                return

    def put(self, key: str, chunk: dict[str, Any]) -> asyncio.Future:
        """Queue a stream's chunk for the next batch; the future resolves once that batch is
        out."""
        self.outbox.setdefault(key, []).append(chunk)
        self.puts += 1
        self.ready.set()
        return self.shipped

    def take(self) -> tuple[dict[str, list[dict[str, Any]]], asyncio.Future]:
        batch, self.outbox = self.outbox, {}
        shipped = self.shipped
        self.shipped = asyncio.get_running_loop().create_future()
        self.ready.clear()
        return batch, shipped

    def close(self) -> None:
        self.closed = True
        if not self.shipped.done():
            self.shipped.cancel()
        for task in list(self.drivers.values()):
            task.cancel()


class TokenBatches:
    """Mixin of WorkerActor (which provides `generate`, `resume` and `incarnation`)."""

    incarnation: str
    _subs: dict[str, Subscription]  # sub id -> subscription, set up by WorkerActor

    @ray.method(_generator_backpressure_num_objects=SUBSCRIPTION_BACKPRESSURE)
    async def subscribe(self, sub_id: str) -> AsyncIterator[dict[str, Any]]:
        """Yield {"subscribed": incarnation} once, then batches {stream key: [chunks]}."""
        sub = Subscription(sub_id)
        self._subs[sub_id] = sub
        try:
            yield {"subscribed": self.incarnation}
            while True:
                await sub.ready.wait()
                await sub.settle()
                batch, shipped = sub.take()
                if batch:
                    yield {"batch": batch}
                if not shipped.done():
                    shipped.set_result(None)
        finally:
            if self._subs.get(sub_id) is sub:
                del self._subs[sub_id]
            sub.close()  # its requests' consumer is gone: abort them all

    async def start(
        self, sub_id: str, request_id: str, prompt: list[int] | str, params: dict[str, Any],
        slot_id: str | None = None, key: str | None = None, lora: str | None = None,
        handoff: bool = False,
    ) -> bool:
        """Start a request whose chunks go out on subscription `sub_id` under `key` (the
        ingress's name for this attempt; the request id by default). `handoff`: prefill
        only, then the stream goes to its decode worker. False when this worker has no such
        subscription (it restarted since): the ingress subscribes anew."""
        return self._drive(sub_id, key or request_id,
                           self.generate(request_id, prompt, params, slot_id, lora,  # type: ignore[attr-defined]
                                         handoff))

    async def start_resume(
        self, sub_id: str, request_id: str, slot_id: str | None = None, key: str | None = None,
    ) -> bool:
        """Stream a request imported here (a moved stream) on subscription `sub_id`."""
        return self._drive(sub_id, key or request_id,
                           self.resume(request_id, slot_id))  # type: ignore[attr-defined]

    def subscriptions(self) -> dict[str, int]:
        """Open subscriptions and how many requests each is streaming (tests, drills)."""
        return {k: len(s.drivers) for k, s in self._subs.items()}

    def _drive(self, sub_id: str, key: str, chunks: AsyncIterator[dict[str, Any]]) -> bool:
        sub = self._subs.get(sub_id)
        if sub is None or sub.closed:
            asyncio.get_running_loop().create_task(chunks.aclose())  # type: ignore[attr-defined]
            return False
        sub.drivers[key] = asyncio.get_running_loop().create_task(
            self._ship(sub, key, chunks))
        return True

    async def _ship(
        self, sub: Subscription, key: str, chunks: AsyncIterator[dict[str, Any]]
    ) -> None:
        last: dict[str, Any] = {}
        try:
            async for last in chunks:
                # the per-request backpressure; shielded: a cancelled driver must not cancel
                # the future every other stream of the batch waits on
                await asyncio.shield(sub.put(key, last))
            if not is_last(last):  # aborted here, or ended without a word: say so
                sub.put(key, {"end": True})
        except asyncio.CancelledError:
            pass  # the subscription closed: `aclose` below aborts the request
        except Exception as e:
            log.exception("streaming request %s failed", key)
            sub.put(key, {"error": "internal", "message": str(e)})
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
            if sub.drivers.get(key) is asyncio.current_task():
                del sub.drivers[key]
