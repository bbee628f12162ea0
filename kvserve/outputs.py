"""Results returned to users of the offline API and, later, over the wire."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class Usage(NamedTuple):
    """Token counts of a request (a tuple: an output per stream per step makes one)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)  # one per stream per step: slots make it smaller and quicker to build
class RequestOutput:
    """One request's state after an engine step. While the request runs, `token_ids`,
    `logprobs` and `top_logprobs` are its live lists, which keep growing after the output
    was made: read them up to `usage.completion_tokens`, or use the delta fields."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "abort"; None while running
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    usage: Usage = field(default_factory=Usage)
    # what this step added, for streaming: new tokens and the text safe to show
    delta_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    # seconds from arrival in the engine to the first scheduled step; None until scheduled
    queue_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
