"""Per-request state: tokens, sampling parameters, stop conditions, streamed text."""

from __future__ import annotations

import enum
import functools
import time

import torch

from kvserve.kvcache.host_cache import ParkedKV
from kvserve.kvcache.manager import StreamStep
from kvserve.outputs import RequestOutput, Usage
from kvserve.sampling import SamplingParams
from kvserve.workers.loading.tokenizer import IncrementalDetokenizer, Tokenizer

_usage = functools.partial(tuple.__new__, Usage)  # Usage((p, c, n)) without a Python frame


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        generator: torch.Generator | None,
        max_model_len: int,
        arrival: int,
        priority: int = 0,
    ) -> None:
        # The attributes every step reads come first, in the order the step reads them: an
        # instance keeps its attribute values in assignment order, so the step touches a few
        # adjacent cache lines per stream rather than all of them.
        # read by the sampler
        self.params = params
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []
        self.generator = generator
        # read by append() and to_output()
        # prompt + output ids, one list grown per token (not rebuilt every step); read-only
        # for everyone else (`set_output_ids` replaces both)
        self.all_ids: list[int] = list(prompt_ids)
        self.logprobs: list[float] | None = [] if params.logprobs is not None else None
        self.top_logprobs: list[list[tuple[int, float]]] | None = (
            [] if params.logprobs else None
        )
        self.eos_ids = set(tokenizer.eos_token_ids)
        # what a token is checked against every step, worked out once
        self._stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        self._min_tokens = params.min_tokens
        self.text = ""  # output text, stop string excluded unless asked
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self._detok_push = self.detok.push
        self._stops = bool(params.stop)
        self.max_model_len = max_model_len
        # the most tokens this stream can reach (prompt + max_tokens, capped by the model)
        self.max_len = min(max_model_len, len(prompt_ids) + params.max_tokens)
        self._max_out = self.max_len - len(prompt_ids)
        self.finish_reason: str | None = None
        # the longest stop string minus one char: text that may still become a stop match
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        self.emitted = 0  # characters of `text` already streamed
        self.request_id = request_id
        self.prompt = prompt
        self.stop_reason: str | int | None = None
        self.num_cached_prompt = 0
        self.scheduled_time: float | None = None  # first step that computed this stream
        self.arrival_time = time.monotonic()
        # read by the scheduler
        # asynchronous scheduling: the row of this stream's next token in the last launched
        # step's sampled ids while that token is still on the device (-1: none in flight)
        self.inflight_row = -1
        # set by a feature that needs each token on the host before the next step is planned
        # (e.g. a grammar mask built from it): the scheduler then waits for the stream's last
        # token before scheduling it again, so its own steps never overlap
        self.requires_sync = False
        # what the scheduler asks the KV manager for this stream while it runs (updated in
        # place every step)
        self.kv_step = StreamStep(request_id, self.all_ids, 0)
        self.status = Status.WAITING
        # the rest
        self.arrival = arrival
        self.priority = priority
        # set while the stream is evicted (parked) and until its first step back has run
        self.parked_kv: ParkedKV | None = None
        self.num_evictions = 0

    def set_output_ids(self, ids: list[int]) -> None:
        """Replace the generated ids (a snapshot resuming here)."""
        self.output_ids = list(ids)
        self.all_ids = self.prompt_ids + self.output_ids

    def append(self, token: int, logprob: float | None, top: list[tuple[int, float]] | None) -> None:
        """Add a sampled token and check every stop condition (runs for every stream every
        step: the common case is a few list appends, one set lookup and one detokenizer push)."""
        out = self.output_ids
        out.append(token)
        self.all_ids.append(token)
        if logprob is not None and self.logprobs is not None:
            self.logprobs.append(logprob)
        if top is not None and self.top_logprobs is not None:
            self.top_logprobs.append(top)
        n_out = len(out)
        if token in self._stop_ids and n_out >= self._min_tokens:
            self.text += self.detok.flush()
            self._finish("stop", token)
            return
        prev = len(self.text)
        delta = self._detok_push(token)
        if delta:
            self.text += delta
        if self._stops and n_out >= self._min_tokens and self._check_stop_strings(prev):
            return
        if n_out >= self._max_out:
            self.text += self.detok.flush()
            self._finish("length", None)

    def _check_stop_strings(self, prev_len: int) -> bool:
        # a new match must end in the new text, so it starts at most `holdback` chars before it
        start = max(0, prev_len - self.holdback)
        best: tuple[int, str] | None = None
        for s in self.params.stop:
            i = self.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.text = self.text[: i + len(s)] if self.params.include_stop_str_in_output else self.text[:i]
        self._finish("stop", s)
        return True

    def _finish(self, reason: str, stop: str | int | None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop

    def abort(self) -> None:
        if self.status != Status.FINISHED:
            self._finish("abort", None)

    def text_delta(self) -> str:
        """New text safe to stream: held back while it could still start a stop string."""
        end = len(self.text) if self.finish_reason else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    def skip_delta(self) -> None:
        """Mark the text as streamed as far as `text_delta` would, without slicing it."""
        if not self.finish_reason:
            self.emitted = max(self.emitted, len(self.text) - self.holdback)

    def to_output(self, delta_tokens: int = 0) -> RequestOutput:
        """A snapshot; the delta fields carry the last `delta_tokens` tokens and unsent text.

        `token_ids`, `logprobs` and `top_logprobs` are the request's own lists, not copies:
        while it runs they keep growing (read them up to `usage.completion_tokens`, or use
        the delta fields), so an output costs the same at any length."""
        out = self.output_ids
        n = len(out)
        if delta_tokens == 1:
            delta_ids = [out[-1]]
        else:
            delta_ids = out[n - delta_tokens :] if delta_tokens else []
        # the text safe to stream (as text_delta), inline: this runs for every stream every step
        text = self.text
        end = len(text)
        if self.finish_reason is None and self.holdback:
            end = max(self.emitted, end - self.holdback)
        delta = text[self.emitted : end]
        self.emitted = end
        # positional arguments: cheaper than keywords
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_ids, text, out, self.finish_reason,
            self.stop_reason, self.logprobs, self.top_logprobs,
            _usage((len(self.prompt_ids), self.num_cached_prompt, n)), delta_ids, delta,
            None if self.scheduled_time is None else self.scheduled_time - self.arrival_time,
        )
