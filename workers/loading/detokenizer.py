"""Streaming token ids -> text deltas, in O(window) per step rather than O(sequence).

Decoding is not per-token: a multi-byte character can span tokens, and SentencePiece decoders
strip the sequence's first space. So each step decodes a short window twice -- the already-emitted
tail (`_prefix:_read`) and that tail plus the new tokens -- and emits the difference. The window
only moves forward at points where the decoded text ends on a whole character, which makes the
deltas concatenate to the full decode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvserve.workers.loading.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
# Prompt tokens kept as left context; a few are enough to settle leading-space handling.
_PROMPT_CONTEXT = 4


class IncrementalDetokenizer:
    """Turns generated ids into text deltas that never end in a partial UTF-8 character.

    Without `prompt_ids`, the deltas concatenate (after `flush`) to `tokenizer.decode(generated)`.
    With them, the prompt's tail is decoding context: the text is what the generated ids add to
    the prompt's text, which for SentencePiece vocabularies keeps the leading space of the first
    generated word. For byte-level vocabularies both are the same.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self.text = ""
        context = self._keep(list((prompt_ids or [])[-_PROMPT_CONTEXT:]))
        # Context that ends mid-character would make the first delta start with its broken tail.
        if context and not self._decode(context).endswith(REPLACEMENT):
            self._ids = context
        self._prefix = 0  # window start: text of _ids[_prefix:_read] was emitted (or is context)
        self._read = len(self._ids)  # ids before this are accounted for in self.text

    def _keep(self, ids: list[int]) -> list[int]:
        # Ids past the vocabulary and skipped special tokens produce no text. Leaving them out
        # keeps the window from growing on them, and keeps a window from starting with only
        # such ids, where a SentencePiece decoder would take the next word as the text's start
        # and drop its space.
        tok = self._tok
        return [
            i
            for i in ids
            if tok.id_to_token(i) is not None and not (self._skip and tok.is_special(i))
        ]

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _delta(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if not final:
            # An incomplete character: wait for the tokens that finish it. No text yet (a
            # SentencePiece "▁" at the start): wait too, so the window keeps a visible token.
            if after.endswith(REPLACEMENT) or after == before:
                return ""
        if after.startswith(before):
            delta = after[len(before) :]
        else:  # not expected from tokenizers' decoders; emit what differs rather than fail
            same = next(
                (i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b),
                len(before),
            )
            delta = after[same:]
        self._prefix, self._read = self._read, len(self._ids)
        if self._prefix > 64:  # forget ids no window will read again
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        self.text += delta
        return delta

    def step(self, new_ids: list[int]) -> str:
        """Append generated ids; return the text they complete (possibly "")."""
        self._ids.extend(self._keep(list(new_ids)))
        return self._delta(final=False)

    def flush(self) -> str:
        """Emit whatever is held back (a trailing incomplete character decodes as U+FFFD)."""
        return self._delta(final=True)
