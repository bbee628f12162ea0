"""One logical stream per request, whichever workers serve it.

A worker whose stream was moved (or handed from its prefill worker to its decode worker)
ends it with a {"moved_to": idx} item; the relay then
continues on that worker (`start_resume`). Both sides know which tokens were delivered (the
snapshot carries the output so far and the detokenizer state), so the client sees each
token exactly once, and the final worker's `usage` counts the whole request. The router
moves the request's slot with the stream (`on_move`), so the one to release is the last
worker's. Chunks arrive through the replica's batched token path (token_demux.py).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvserve.deploy.token_demux import Start, TokenDemux


class StreamRelay:
    def __init__(
        self, workers: list[Any], idx: int, request_id: str,
        on_move: Callable[[int, int], Any], slot_id: str | None = None,
        demux: TokenDemux | None = None, handoff: bool = False,
    ) -> None:
        """`handoff`: the first worker only prefills; after the first token the router
        hands the stream to its decode worker, and the relay continues there."""
        self.workers = workers
        self.idx = idx  # the worker serving the stream now
        self.request_id = request_id
        self.on_move = on_move  # moves the request's router slot along (src, dst); may be async
        self.slot_id = slot_id  # the target reports it to the router as its own
        self.demux = demux or TokenDemux()
        self.moves = 0
        self.handoff = handoff

    @property
    def worker(self) -> Any:
        return self.workers[self.idx]

    async def chunks(
        self, prompt_ids: list[int], params: dict[str, Any], lora: str | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """Chunks of the request started on the current worker, then of each worker the
        stream moves to; the move markers themselves are not passed on. `lora`: the LoRA
        adapter it runs with (a moved stream keeps it)."""
        rid, slot_id, worker = self.request_id, self.slot_id, self.worker
        kw = {"handoff": True} if self.handoff else {}
        start: Start = lambda sub_id, key: worker.start.remote(  # noqa: E731
            sub_id, rid, prompt_ids, params, slot_id, key, lora=lora, **kw)
        while True:
            moved_to: int | None = None
            async for chunk in self.demux.stream(self.idx, self.worker, rid, start):
                if "moved_to" in chunk:
                    moved_to = int(chunk["moved_to"])
                    continue  # the last chunk from this worker
                if "error" in chunk and self.moves:  # the request was fine: the move was not
                    chunk = {**chunk, "error": "internal"}
                yield chunk
            if moved_to is None:
                return
            # Ray runs one caller's calls to an actor in order: this lands before the release
            moved = self.on_move(self.idx, moved_to)
            if inspect.isawaitable(moved):  # it may first fetch the handle of a new worker
                await moved
            self.idx, self.moves = moved_to, self.moves + 1
            start = self._resume(self.worker)

    def _resume(self, worker: Any) -> Start:
        rid, slot_id = self.request_id, self.slot_id
        return lambda sub_id, key: worker.start_resume.remote(sub_id, rid, slot_id, key)
