"""Driving an engine by hand to the end, as the engine-level tests do."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def run_to_end(eng: Any, on_step: Callable[[Any], None] | None = None) -> dict[str, list[int]]:
    """Step `eng` until no request is left: each finished request's token ids, by request id.
    The KV manager's invariants are checked after every step, then `on_step(eng)` runs."""
    got: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                got[o.request_id] = o.token_ids
        eng.check_invariants()
        if on_step is not None:
            on_step(eng)
    return got


async def held_mid_stream(w: Any, rid: str, prompt: list[int], params: dict,
                          steps: int) -> tuple[Any, list[dict]]:
    """Request `rid` started on worker body `w` with its engine held: `steps` steps run and
    its first chunk read; it goes on only once the caller unpauses the engine. Returns the
    chunk generator and that first chunk."""
    import asyncio
    import time

    await w.engine.pause()
    gen = w.generate(rid, prompt, params)
    first = asyncio.ensure_future(gen.__anext__())
    deadline = time.monotonic() + 30
    while rid not in w.engine.unfinished_ids():
        assert time.monotonic() < deadline, f"{rid} never reached the engine"
        await asyncio.sleep(0.01)
    for _ in range(steps):
        await w.engine.step()
    return gen, [await first]
