"""OpenAI `n`: several choices for one prompt, as that many requests run side by side.

Each choice is its own request (id `<id>-<i>`); with a `seed`, choice i samples with
seed + i, so the choices differ yet repeat. The router's pending-prefix affinity sends them
to one worker, whose prefix cache then holds the prompt's KV once for all of them.
A failing choice fails the whole answer; the others are cancelled, which aborts them on
their workers and frees their KV, as a client disconnect does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from kvserve.deploy.errors import ServiceError
from kvserve.deploy.service import GenRequest, Result, Service
from kvserve.deploy.slots import Leases

MAX_CHOICES = 16


def num_choices(n: int | None) -> int:
    if n is None:
        return 1
    if not 1 <= n <= MAX_CHOICES:
        raise ServiceError("invalid", f"n must be between 1 and {MAX_CHOICES}, got {n}")
    return n


def fan_out(req: GenRequest, n: int) -> list[GenRequest]:
    if n == 1:
        return [req]
    seed = req.params.seed
    return [
        GenRequest(f"{req.request_id}-{i}", req.prompt_ids,
                   req.params.model_copy(update={"seed": None if seed is None else seed + i}),
                   req.session_id)
        for i in range(n)
    ]


async def complete_all(svc: Service, reqs: list[GenRequest], leases: Leases) -> list[Result]:
    tasks = [asyncio.ensure_future(svc.complete(r, leases)) for r in reqs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:  # after a failure (or our own cancellation): stop the rest
            t.cancel()


async def stream_all(
    svc: Service, reqs: list[GenRequest], leases: Leases
) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """(choice index, chunk) as the chunks arrive, until every choice has finished."""
    if len(reqs) == 1:
        async with aclosing(svc.stream(reqs[0], leases)) as chunks:  # closed with this one
            async for c in chunks:
                yield 0, c
        return
    queue: asyncio.Queue[tuple[int, dict[str, Any] | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, r: GenRequest) -> None:
        try:
            async with aclosing(svc.stream(r, leases)) as chunks:
                async for c in chunks:
                    await queue.put((i, c))
            await queue.put((i, None))
        except Exception as e:  # handed to the consumer, which fails the answer
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
    try:
        open_ = len(reqs)
        while open_:
            i, item = await queue.get()
            if item is None:
                open_ -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
