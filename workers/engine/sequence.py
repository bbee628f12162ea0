"""Per-request state: tokens, sampling parameters, stop conditions, streamed text."""

from __future__ import annotations

import enum
import functools
import time
from typing import TYPE_CHECKING

import torch

from kvserve.kvcache.host_cache import ParkedKV
from kvserve.kvcache.manager import StreamStep
from kvserve.kvcache.restore_cost import Choice
from kvserve.outputs import RequestOutput, Usage
from kvserve.sampling import SamplingParams
from kvserve.workers.loading.tokenizer import IncrementalDetokenizer, Tokenizer
from kvserve.workers.structured.state import GrammarState

if TYPE_CHECKING:
    from kvserve.workers.engine.adapters import Adapter
    from kvserve.workers.engine.spec_policy import SpecState

# no proposals (shared, never mutated)
NO_DRAFT: list[int] = []

# Usage((p, c, n)) and RequestOutput((...)) built by tuple.__new__, without a Python frame
_usage = functools.partial(tuple.__new__, Usage)
_output = functools.partial(tuple.__new__, RequestOutput)


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
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens,
                                            keep_text=False)
        self._detok_push = self.detok.push
        self._stops = bool(params.stop)
        # no stop strings and no logprobs: emit() can take its short path
        self._plain = not params.stop and params.logprobs is None
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
        self.prompt_len = len(prompt_ids)
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
        # a structured output's grammar state (set by the engine); with logit_bias, the
        # stream's logits are touched before sampling (`guided`). Its mask is built after the
        # last token was accepted, also under asynchronous scheduling (the engine samples a
        # step only after appending the one before), so a guided stream does not need
        # `requires_sync`.
        self.grammar: GrammarState | None = None
        self.guided = params.logit_bias is not None
        # what the scheduler asks the KV manager for this stream while it runs (updated in
        # place every step)
        self.kv_step = StreamStep(request_id, self.all_ids, 0)
        # its LoRA adapter (None: the base model), the device slot it holds while it runs
        # (-1 otherwise) and whether it holds the adapter's host copy (from creation to exit)
        self.lora: Adapter | None = None
        self.lora_slot = -1
        self.lora_pinned = False
        self.status = Status.WAITING
        # the rest
        self.arrival = arrival
        self.priority = priority
        # set while the stream is evicted (parked) and until its first step back has run
        self.parked_kv: ParkedKV | None = None
        # how a parked stream comes back (by copy or recomputed, and why), set on admission
        self.restore_choice: Choice | None = None
        self.num_evictions = 0
        # speculative decoding: this step's proposed tokens (read by the scheduler; a new list
        # each step, never mutated) and the stream's acceptance record (`spec_policy.py`)
        self.draft: list[int] = NO_DRAFT
        self.spec: SpecState | None = None
        # an unseeded sampled stream's noise for one step, shared by a draft model and the
        # target's rows (`speculative.py`)
        self.spec_gen: torch.Generator | None = None
        # prefilled here for another worker (disaggregated serving): once its first token is
        # sampled it is not planned again; the async engine holds it for the hand-off
        self.handoff = False

    def set_output_ids(self, ids: list[int]) -> None:
        """Replace the generated ids (a snapshot resuming here)."""
        self.output_ids = list(ids)
        self.all_ids = self.kv_step.token_ids = self.prompt_ids + self.output_ids

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
        delta = self._detok_push(token)
        if self._stops:
            prev = len(self.text)
            self.text += delta
            if n_out >= self._min_tokens and self._check_stop_strings(prev):
                return
        elif delta:
            self.text += delta
        if n_out >= self._max_out:
            self.text += self.detok.flush()
            self._finish("length", None)

    def emit(self, token: int) -> RequestOutput:
        """`append(token, None, None)` then `to_output(1)`, in one call: the engine's path for
        every stream every step. A token that is not a stop id nor the last one allowed, of a
        request without stop strings or logprobs, takes a short path with the same result."""
        out = self.output_ids
        if not self._plain or token in self._stop_ids or len(out) + 1 >= self._max_out:
            self.append(token, None, None)
            return self.to_output(1)
        out.append(token)
        self.all_ids.append(token)
        text = self.text
        delta = self._detok_push(token)
        if delta:
            text = self.text = text + delta
        start = self.emitted
        end = self.emitted = len(text)  # no stop strings: nothing is held back
        st = self.scheduled_time
        return _output((
            self.request_id, self.prompt, self.prompt_ids, text, out, None, None, None, None,
            _usage((self.prompt_len, self.num_cached_prompt, len(out))), [token], text[start:end],
            None if st is None else st - self.arrival_time,
        ))

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
        start = self.emitted
        end = len(text)
        if self.holdback and self.finish_reason is None:
            end = max(start, end - self.holdback)
        self.emitted = end
        st = self.scheduled_time
        return _output((
            self.request_id, self.prompt, self.prompt_ids, text, out, self.finish_reason,
            self.stop_reason, self.logprobs, self.top_logprobs,
            _usage((self.prompt_len, self.num_cached_prompt, n)), delta_ids, text[start:end],
            None if st is None else st - self.arrival_time,
        ))
