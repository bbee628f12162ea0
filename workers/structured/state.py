"""A constrained stream's grammar state: the matcher, advanced by every token it outputs.

It lives with the stream's Sequence, in process, so eviction to the host tier and restore
leave it as it is; a snapshot carries the spec (in the sampling parameters) and the output
ids, and the importing engine rebuilds the matcher by replaying them (`replay`).
"""

from __future__ import annotations

from typing import Any

from kvserve.errors import InvalidRequestError
from kvserve.structured import StructuredOutput


class GrammarState:
    def __init__(self, spec: StructuredOutput, matcher: Any) -> None:
        self.spec = spec
        self.matcher = matcher
        self.broken = False  # a token the grammar refused was sampled (a bug, logged once)

    def accept(self, token: int) -> bool:
        return bool(self.matcher.accept_token(token))

    def replay(self, token_ids: list[int]) -> None:
        """Advance a fresh matcher over a moved stream's output so far."""
        for i, t in enumerate(token_ids):
            if not self.accept(t):
                raise InvalidRequestError(
                    f"the stream's output token {i} ({t}) does not match its {self.spec.type} "
                    "constraint; the snapshot does not belong to this model's tokenizer")

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())
