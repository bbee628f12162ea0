"""Speculative decoding settings, with vLLM's names (`--speculative-config` JSON).

`method` "ngram" proposes the tokens that followed the latest earlier occurrence of the
stream's last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) in its prompt
and output; "draft_model" runs a smaller model that shares the target's tokenizer. The target
verifies every proposal of a step in that one step (`docs/design.md`, "Speculative decoding").
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# proposals per stream and step at most: verifying more positions than this costs more than
# the rows' qgemv path holds on the CPU, and acceptance falls geometrically with the length
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_LOOKUP_MAX = 5
DEFAULT_LOOKUP_MIN = 2


class SpeculativeConfig(BaseModel):
    """How an engine speculates; None on `EngineConfig.speculative_config` = it does not."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    method: Literal["ngram", "draft_model"] | None = Field(
        None, description="'ngram' (prompt lookup) or 'draft_model'; default: 'draft_model' "
                          "when `model` is given, else 'ngram'")
    num_speculative_tokens: int = Field(
        ge=1, le=MAX_SPECULATIVE_TOKENS,
        description="tokens proposed per stream and step at most (fewer where acceptance or "
                    "the step's cost say so)")
    prompt_lookup_min: int | None = Field(
        None, ge=1, description=f"ngram: shortest n-gram matched (default {DEFAULT_LOOKUP_MIN}, "
                                "or prompt_lookup_max when that is smaller)")
    prompt_lookup_max: int | None = Field(
        None, ge=1, description=f"ngram: longest n-gram matched (default {DEFAULT_LOOKUP_MAX}, "
                                "or prompt_lookup_min when that is larger)")
    model: str | None = Field(
        None, description="draft_model: the draft (GGUF file, HF directory or Hub name); it "
                          "must share the target's tokenizer")
    disable_by_batch_size: int | None = Field(
        None, ge=1, description="no speculation in a step with at least this many running "
                                "streams; None = decided by the measured cost only")

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.method is None:
            self.method = "draft_model" if self.model else "ngram"
        if self.method == "draft_model":
            if not self.model:
                raise ValueError("method 'draft_model' needs `model` (the draft model)")
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise ValueError("prompt_lookup_min / prompt_lookup_max belong to method "
                                 "'ngram', not 'draft_model'")
            return self
        if self.model:
            raise ValueError("method 'ngram' takes no `model` (use method 'draft_model')")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None:
            lo = min(DEFAULT_LOOKUP_MIN, hi if hi is not None else DEFAULT_LOOKUP_MAX)
        if hi is None:
            hi = max(DEFAULT_LOOKUP_MAX, lo)
        if lo > hi:
            raise ValueError(f"prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        return self


def parse_speculative_config(value: str | dict[str, Any] | SpeculativeConfig | None
                             ) -> SpeculativeConfig | None:
    """A config from JSON text (`--speculative-config`), a dict or a config; ValueError with
    one line naming what is wrong."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative config is not valid JSON: {e}") from None
        if value is None:
            return None
    if not isinstance(value, dict):
        raise ValueError(f"speculative config must be a JSON object, got {type(value).__name__}")
    try:
        return SpeculativeConfig(**value)
    except ValidationError as e:
        raise ValueError("speculative config: " + "; ".join(_line(err) for err in e.errors())) from None


def _line(err: Any) -> str:
    loc = ".".join(str(x) for x in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"unknown field {loc!r}"
    msg = str(err["msg"]).removeprefix("Value error, ")
    return f"{loc}: {msg}" if loc else msg
