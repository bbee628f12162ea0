"""Results returned to users of the offline API and, later, over the wire."""

from __future__ import annotations

from typing import NamedTuple


class Usage(NamedTuple):
    """Token counts of a request (a tuple: an output per stream per step makes one)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class RequestOutput(NamedTuple):
    """One request's state after an engine step (a tuple: one is made per stream per step,
    and a tuple is built in one call). While the request runs, `token_ids`, `logprobs` and
    `top_logprobs` are its live lists, which keep growing after the output was made: read
    them up to `usage.completion_tokens`, or use the delta fields."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = []  # noqa: RUF012 (never mutated: outputs are read-only)
    finish_reason: str | None = None  # "stop", "length" or "abort"; None while running
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    usage: Usage = Usage()
    # what this step added, for streaming: new tokens and the text safe to show
    delta_token_ids: list[int] = []  # noqa: RUF012
    delta_text: str = ""
    # seconds from arrival in the engine to the first scheduled step; None until scheduled
    queue_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
