"""Per-request sampling parameters (vLLM / OpenAI names, defaults and ranges)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvserve.errors import InvalidRequestError
from kvserve.structured import StructuredOutput

# Temperatures below this count as greedy: dividing logits by ~0 would overflow to inf and
# turn the softmax into NaN, and such a temperature is argmax in all but name (vLLM does the same).
GREEDY_TEMPERATURE_EPS = 1e-5

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value
MAX_LOGIT_BIAS_ENTRIES = 1024

_INT_FIELDS = ("max_tokens", "top_k", "seed", "logprobs", "min_tokens", "n")


class SamplingParams(BaseModel):
    """How to pick each next token of one request and when to stop.

    Invalid values raise pydantic's ValidationError; request handlers should build through
    `SamplingParams.validated(...)` / `parse_sampling_params(...)`, which raise
    InvalidRequestError with a one-line message instead.
    """

    # allow_inf_nan=False: pydantic accepts nan/inf floats by default, and a NaN temperature
    # or top_p would silently poison the whole batch's sampling.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True)

    max_tokens: int = Field(16, ge=1, description="tokens to generate at most")
    temperature: float = Field(1.0, ge=0, description="0 = greedy")
    top_k: int = Field(-1, description="keep the k likeliest tokens; -1 or 0 = off")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus mass; 1 = off")
    min_p: float = Field(0.0, ge=0, le=1, description="drop tokens below min_p * max prob")
    repetition_penalty: float = Field(1.0, gt=0, description="HF-style; 1 = off")
    presence_penalty: float = Field(0.0, ge=-2, le=2, description="OpenAI-style; 0 = off")
    frequency_penalty: float = Field(0.0, ge=-2, le=2, description="OpenAI-style; 0 = off")
    seed: int | None = Field(None, description="per-request seed; None = engine generator")
    logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="top-n logprobs; 0 = chosen token only"
    )
    ignore_eos: bool = False
    stop: list[str] = Field(default_factory=list, description="stop strings")
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = Field(0, ge=0, description="EOS / stop tokens are banned before this many")
    n: int = Field(1, description="completions per request; only 1 is supported")
    logit_bias: dict[int, float] | None = Field(
        None, description="token id -> value added to its logit (-100..100) before sampling"
    )
    structured: StructuredOutput | None = Field(
        None, description="the output must match this JSON schema, regex or grammar"
    )

    @field_validator(*_INT_FIELDS, mode="before")
    @classmethod
    def _no_bool_ints(cls, v: Any) -> Any:
        # pydantic's lax mode takes True as 1; a JSON `"max_tokens": true` is a client bug.
        if isinstance(v, bool):
            raise ValueError("must be an integer, not a boolean")
        return v

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, v: int) -> int:
        if v < -1:
            raise ValueError("must be -1 or 0 (disabled) or >= 1")
        return v

    @field_validator("n")
    @classmethod
    def _check_n(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_to_list(cls, v: Any) -> Any:
        # OpenAI accepts a single string or null for `stop`.
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        return v

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: list[str]) -> list[str]:
        # An empty stop string would match at once and end every request with no output.
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_ids(cls, v: list[int]) -> list[int]:
        bad = [t for t in v if t < 0]
        if bad:
            raise ValueError(f"token ids must be >= 0, found {bad[0]}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        if not v:
            return None
        if len(v) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} tokens may be biased, got {len(v)}")
        for tok, bias in v.items():
            if tok < 0:
                raise ValueError(f"token id {tok} is negative")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"the bias of token {tok} is {bias}; it must be between "
                                 f"-{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}")
        return v

    @model_validator(mode="after")
    def _check_min_tokens(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if self.structured is not None:
            # the grammar ends the output with EOS where it is complete: a request that bans
            # EOS there would have no token left to choose
            what = ("a strict function (its calls are a structured output)"
                    if self.structured.type == "structural_tag" else "a structured output")
            if self.ignore_eos:
                raise ValueError(f"ignore_eos cannot be combined with {what} "
                                 "(the output ends where the structure is complete)")
            if self.min_tokens:
                raise ValueError(f"min_tokens cannot be combined with {what} "
                                 "(the output ends where the structure is complete)")
        return self

    @property
    def greedy(self) -> bool:
        """Whether the next token is the argmax (no randomness, no generator draws)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    @classmethod
    def validated(cls, **kwargs: Any) -> SamplingParams:
        """Build from client input, raising InvalidRequestError with a one-line message."""
        try:
            return cls(**kwargs)
        except ValidationError as e:
            raise InvalidRequestError(format_validation_error(e)) from None


def parse_sampling_params(data: Mapping[str, Any] | None) -> SamplingParams:
    """Build from a client's dict (None = all defaults); errors become InvalidRequestError."""
    if data is None:
        return SamplingParams()
    if not isinstance(data, Mapping):
        raise InvalidRequestError(
            f"sampling parameters must be an object, got {type(data).__name__}"
        )
    bad_keys = [k for k in data if not isinstance(k, str)]
    if bad_keys:
        raise InvalidRequestError(f"sampling parameter names must be strings, got {bad_keys[0]!r}")
    return SamplingParams.validated(**data)


def format_validation_error(e: ValidationError) -> str:
    """One line naming each bad field, the constraint and the value given."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown sampling parameter {loc!r}")
            continue
        msg = err["msg"]
        if msg.startswith("Value error, "):  # pydantic's prefix for our own ValueErrors
            msg = msg[len("Value error, ") :]
        where = f"{loc}: " if loc else ""
        value = f" (got {err['input']!r})" if loc and "input" in err else ""
        parts.append(f"{where}{msg}{value}")
    return "invalid sampling parameters: " + "; ".join(parts)
