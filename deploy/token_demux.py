"""The ingress replica's end of the batched token path: one subscription per worker.

`TokenDemux.stream` starts a request on a worker and yields its chunks. Chunks do not come
from a Ray stream of their own: each worker this replica uses has one long-lived
`subscribe` stream (`WorkerFeed`), whose batches {stream key: [chunks]} a reader task
sorts into the requests' inboxes (token_inbox.py). The key names one attempt of one request
on one worker, not the request id: a client may send a request id that is still running
(the worker refuses the second with "in use"), and the refusal must reach the second
request while the first keeps its own chunks. When the worker dies, the reader fails
exactly the inboxes of that worker's requests with Ray's error, so the service retries
them or answers UNAVAILABLE as before; the next request subscribes to the restarted worker.
The subscription runs outside any request's Ray task (`outside_request`): a client that
cancels its request must not cancel the stream every other request shares.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from kvserve.deploy.slots import outside_request
from kvserve.deploy.token_inbox import Inbox

# starts a request on a worker, its chunks to go out on subscription `sub_id` under the
# stream key `key`; returns False when the worker does not know that subscription (it
# restarted)
Start = Callable[[str, str], Awaitable[bool]]


class WorkerFeed:
    """One `subscribe` stream from one worker (incarnation) to this replica."""

    def __init__(self, worker: Any, idx: int) -> None:
        self.worker = worker
        self.idx = idx
        self.sub_id = f"sub-{uuid.uuid4().hex}"
        self.inboxes: dict[str, Inbox] = {}  # by stream key
        self.dead = False
        self.batches = 0
        self.loop = loop = asyncio.get_running_loop()
        self.ready: asyncio.Future = loop.create_future()
        self.task = loop.create_task(self._read(), context=outside_request())

    async def _read(self) -> None:
        err: BaseException
        try:
            gen = self.worker.subscribe.remote(self.sub_id)
            hello = await (await gen.__anext__())
            self.ready.set_result(hello["subscribed"])
            async for ref in gen:
                batch = (await ref)["batch"]
                self.batches += 1
                for key, chunks in batch.items():
                    box = self.inboxes.get(key)
                    if box is not None:  # else its consumer is gone: dropped
                        for chunk in chunks:
                            box.put(chunk)
            err = RuntimeError(f"worker {self.idx} closed its token stream")
        except Exception as e:  # the worker died (RayActorError) or its objects did
            err = e
        self.dead = True
        if not self.ready.done():
            self.ready.set_exception(err)
        for box in self.inboxes.values():
            box.fail(err)

    def close(self) -> None:
        self.task.cancel()


class TokenDemux:
    def __init__(self) -> None:
        self.feeds: dict[int, WorkerFeed] = {}
        self._keys = itertools.count()

    def forget(self) -> None:
        """The router has new workers: later requests subscribe to them."""
        for feed in self.feeds.values():
            if not feed.inboxes:
                feed.close()
        self.feeds = {}

    async def stream(
        self, idx: int, worker: Any, request_id: str, start: Start
    ) -> AsyncIterator[dict[str, Any]]:
        """Start a request with `start` on worker `idx` and yield its chunks there, up to
        its last one (a finish, an error or a `moved_to`). Raises Ray's error when the
        worker dies."""
        key = f"{request_id}#{next(self._keys)}"
        for _ in range(2):
            feed = self._feed(idx, worker)
            await asyncio.shield(feed.ready)
            box = feed.inboxes[key] = Inbox()
            try:
                started = await start(feed.sub_id, key)
            except BaseException:
                feed.inboxes.pop(key, None)
                raise
            if started and not feed.dead:
                break
            feed.inboxes.pop(key, None)
            if self.feeds.get(idx) is feed:  # the worker restarted: subscribe to the new one
                del self.feeds[idx]
        else:
            raise RuntimeError(f"worker {idx} refused two subscriptions in a row")
        try:
            async for chunk in box.chunks():
                yield chunk
        finally:
            if feed.inboxes.get(key) is box:
                del feed.inboxes[key]

    def _feed(self, idx: int, worker: Any) -> WorkerFeed:
        feed = self.feeds.get(idx)
        # a feed lives on the event loop that opened it (a replica has one; callers that run
        # one loop after another, such as tests driving a Service, get a feed per loop)
        if (feed is None or feed.dead or feed.worker is not worker
                or feed.loop is not asyncio.get_running_loop()):
            feed = self.feeds[idx] = WorkerFeed(worker, idx)
        return feed

    def info(self) -> dict[str, int]:
        feeds = [f for f in self.feeds.values() if not f.dead]
        return {"token_streams": len(feeds), "token_batches": sum(f.batches for f in feeds)}
