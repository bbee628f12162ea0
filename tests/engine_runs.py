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
