"""Streaming token ids -> text deltas, in O(window) per step rather than O(sequence).

Decoding is not per-token: a multi-byte character can span tokens, and SentencePiece decoders
strip the sequence's first space. So each step decodes a short window twice -- the already-emitted
tail (`_prefix:_read`) and that tail plus the new tokens -- and emits the difference. The window
only moves forward at points where the decoded text ends on a whole character, which makes the
deltas concatenate to the full decode.

Byte-level vocabularies (GPT-2 style: Llama 3, Qwen2, SmolLM) skip the window entirely: a token
decodes to a fixed byte string, so each step appends its bytes to an incremental UTF-8 decoder,
O(1) work per token with no tokenizer call after a token's first sight.
"""

from __future__ import annotations

import codecs
from typing import TYPE_CHECKING

from tokenizers import decoders

if TYPE_CHECKING:
    from kvserve.workers.loading.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
# Prompt tokens kept as left context; a few are enough to settle leading-space handling.
_PROMPT_CONTEXT = 4


class BytePieces:
    """Token id -> the bytes a ByteLevel decoder turns it into, learnt on first sight.

    `decode(ids)` of such a tokenizer is the UTF-8 (lossy) decoding of the concatenated
    pieces; special tokens give b"" when skipped and ids past the vocabulary always do.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._specials = tokenizer.special_token_ids
        # the GPT-2 byte alphabet, inverted: printable stand-in character -> byte
        self._byte_of = {c: b for b, c in byte_alphabet().items()}
        self._pieces: dict[int, bytes] = {}
        # a piece's text when it is whole UTF-8 on its own (most are), else None
        self._texts: dict[int, str | None] = {}
        # by skip_special_tokens: id -> its text, for ids whose text is whole (one lookup)
        self.whole: dict[bool, dict[int, str]] = {True: {}, False: {}}

    @classmethod
    def build(cls, tokenizer: Tokenizer) -> BytePieces | None:
        """The table for a tokenizer whose decoder is plain ByteLevel, else None."""
        if not isinstance(tokenizer.backend.decoder, decoders.ByteLevel):
            return None
        table = cls(tokenizer)
        # added tokens are spelled as raw text; check that the decoder agrees with us on them
        for i in tokenizer.backend.get_added_tokens_decoder():
            piece = table.piece(i, skip_special=False)
            if piece.decode("utf-8", "replace") != tokenizer.decode([i], skip_special_tokens=False):
                return None
        return table

    def piece(self, token_id: int, skip_special: bool) -> bytes:
        if skip_special and token_id in self._specials:
            return b""
        piece = self._pieces.get(token_id)
        if piece is None:
            token = self._tok.id_to_token(token_id) if token_id >= 0 else None
            if token is None:
                piece = b""
            else:
                byte_of = self._byte_of
                try:
                    piece = bytes(byte_of[c] for c in token)
                except KeyError:  # not in the byte alphabet: the decoder keeps its UTF-8
                    piece = token.encode("utf-8")
            self._pieces[token_id] = piece
        return piece

    def text(self, token_id: int, skip_special: bool) -> str | None:
        """The piece as text if it decodes on its own, else None (a split character)."""
        if skip_special and token_id in self._specials:
            self.whole[True][token_id] = ""
            return ""
        try:
            return self._texts[token_id]
        except KeyError:
            pass
        try:
            text: str | None = self.piece(token_id, False).decode("utf-8")
        except UnicodeDecodeError:
            text = None
        self._texts[token_id] = text
        if text is not None:
            self.whole[skip_special][token_id] = text
        return text


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level vocabularies are spelled in."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    shifted = 0x100
    for b in range(256):
        if b not in table:
            table[b] = chr(shifted)
            shifted += 1
    return table


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
        keep_text: bool = True,
    ) -> None:
        """`keep_text=False`: the caller keeps the text itself (`text` is then incomplete)."""
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._parts: list[str] = []  # the text so far, joined when read
        self._keep_text = keep_text
        self._pieces = tokenizer.byte_pieces()
        self._pending = b""  # byte-level: the start of a character split across tokens
        # byte-level: ids whose text is whole, shared by every stream of the tokenizer
        self._whole: dict[int, str] = {} if self._pieces is None else self._pieces.whole[skip_special_tokens]
        if self._pieces is not None:
            return  # the prompt adds nothing to byte-level text: no context window needed
        context = self._keep(list((prompt_ids or [])[-_PROMPT_CONTEXT:]))
        # Context that ends mid-character would make the first delta start with its broken tail.
        if context and not self._decode(context).endswith(REPLACEMENT):
            self._ids = context
        self._prefix = 0  # window start: text of _ids[_prefix:_read] was emitted (or is context)
        self._read = len(self._ids)  # ids before this are accounted for in the text

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
        if self._keep_text:
            self._parts.append(delta)
        return delta

    @property
    def text(self) -> str:
        """Everything emitted so far (with keep_text)."""
        parts = self._parts
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0] if parts else ""

    def _byte_step(self, token_id: int) -> str:
        pieces = self._pieces
        assert pieces is not None
        if not self._pending:
            delta = pieces.text(token_id, self._skip)
            if delta is not None:
                if delta and self._keep_text:
                    self._parts.append(delta)
                return delta
        # bytes of a character split across tokens: decode what is whole, keep the rest
        data = self._pending + pieces.piece(token_id, self._skip)
        delta, used = codecs.utf_8_decode(data, "replace", False)
        self._pending = data[used:]
        if delta and self._keep_text:
            self._parts.append(delta)
        return delta

    def push(self, token_id: int) -> str:
        """`step([token_id])` without the list: one generated id per engine step (for most
        byte-level tokens, one dictionary lookup)."""
        if not self._pending:
            text = self._whole.get(token_id)
            if text is not None:
                if self._keep_text and text:
                    self._parts.append(text)
                return text
        if self._pieces is not None:
            return self._byte_step(token_id)
        return self.step([token_id])

    def step(self, new_ids: list[int]) -> str:
        """Append generated ids; return the text they complete (possibly "")."""
        if self._pieces is not None:
            if len(new_ids) == 1:
                return self._byte_step(new_ids[0])
            return "".join([self._byte_step(i) for i in new_ids])
        self._ids.extend(self._keep(list(new_ids)))
        return self._delta(final=False)

    def flush(self) -> str:
        """Emit whatever is held back (a trailing incomplete character decodes as U+FFFD)."""
        if self._pieces is not None:
            if not self._pending:
                return ""
            delta = codecs.utf_8_decode(self._pending, "replace", True)[0]
            self._pending = b""
            if self._keep_text:
                self._parts.append(delta)
            return delta
        return self._delta(final=True)
