"""One request's chunks in the ingress replica, between its worker's batches and its client.

The subscription's reader (token_demux.py) must never wait for one request's client: every
other stream of the same worker comes through the same reader. So an inbox never blocks
its writer; while the client is behind, the chunks it has not taken merge into one (tokens,
text and logprobs appended, the rest from the latest), as the worker merges engine steps.
What an inbox holds is therefore bounded by its own request's output (`max_tokens`), never
by how far behind its client is.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from kvserve.workers.token_batches import is_last

APPENDED = ("token_ids", "logprobs", "top_logprobs")


def merge(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Two consecutive chunks of one stream as one."""
    out = dict(new)
    for key in APPENDED:
        if old.get(key) is not None or new.get(key) is not None:
            out[key] = list(old.get(key) or ()) + list(new.get(key) or ())
    out["text"] = old["text"] + new["text"]
    return out


class Inbox:
    def __init__(self) -> None:
        self._items: list[dict[str, Any]] = []
        self._event = asyncio.Event()
        self._failure: BaseException | None = None

    def put(self, chunk: dict[str, Any]) -> None:
        """Add a chunk from the worker (never waits)."""
        last = self._items[-1] if self._items else None
        if last is not None and "token_ids" in last and "token_ids" in chunk:
            self._items[-1] = merge(last, chunk)
        else:
            self._items.append(chunk)
        self._event.set()

    def fail(self, error: BaseException) -> None:
        """The stream broke (its worker died): raised once the chunks before it are read."""
        self._failure = error
        self._event.set()

    def pending(self) -> int:
        return len(self._items)

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        """The request's chunks up to its last on this worker ({"end"} markers left out)."""
        while True:
            while not self._items:
                if self._failure is not None:
                    raise self._failure
                await self._event.wait()
                self._event.clear()
            chunk = self._items.pop(0)
            if "end" not in chunk:
                yield chunk
            if is_last(chunk):
                return
