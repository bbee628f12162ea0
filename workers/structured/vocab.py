"""The vocabulary as the grammar engine needs it: each token id's bytes as decoded.

Byte-level BPE (GPT-2 style: SmolLM2, Llama 3, Qwen2) spells every byte as a printable
stand-in character; a token's bytes are those characters mapped back. SentencePiece
vocabularies write a space as U+2581 and unknown bytes as `<0xNN>` tokens. Special (control)
tokens match no text: they get no bytes, so a grammar never produces one, except the
end-of-sequence ids, which the engine allows where the grammar can end. A structural tag's
vocabulary (`spelled`) also holds the special tokens a call format is marked with
(`[TOOL_CALLS]`, `marker_tokens`): as byte 0xFF followed by their text, which no UTF-8 text
holds, so no JSON string or other text rule produces them; the call format's token rules name
them by id (and Mistral's free text ends where their text appears).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tokenizers import decoders

from kvserve.tools.parsers import SPELLED
from kvserve.workers.loading.detokenizer import byte_alphabet
from kvserve.workers.loading.tokenizer import Tokenizer

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@dataclass(frozen=True)
class Vocab:
    tokens: list[bytes]  # by id, len == vocab_size (the logits' width); b"" = never text
    special_ids: list[int]  # control tokens and ids past the tokenizer's vocabulary
    eos_ids: list[int]


def marker_tokens(tokenizer: Tokenizer, vocab_size: int | None = None) -> dict[str, int]:
    """The tokenizer's special tokens that are call markers (`SPELLED`), by text."""
    out = {}
    for text in SPELLED:
        i = tokenizer.token_to_id(text)
        if i is not None and i in tokenizer.special_token_ids and (vocab_size is None
                                                                    or i < vocab_size):
            out[text] = i
    return out


def build_vocab(tokenizer: Tokenizer, vocab_size: int, spelled: frozenset[int] = frozenset()
                ) -> Vocab:
    """The token bytes of `tokenizer`, padded to the model's `vocab_size` (logit rows); the
    special tokens in `spelled` as their text."""
    byte_level = isinstance(tokenizer.backend.decoder, decoders.ByteLevel)
    byte_of = {c: b for b, c in byte_alphabet().items()}
    specials = tokenizer.special_token_ids
    added = tokenizer.backend.get_added_tokens_decoder()
    tokens: list[bytes] = []
    special_ids: list[int] = []
    for i in range(vocab_size):
        tok = tokenizer.id_to_token(i) if i < tokenizer.vocab_size else None
        if i in spelled and tok:
            tokens.append(b"\xff" + tok.encode("utf-8"))
            continue
        if tok is None or i in specials:
            tokens.append(b"")
            special_ids.append(i)
            continue
        if i in added:  # added (non-special) tokens are spelled as their raw text
            tokens.append(tok.encode("utf-8"))
        elif byte_level:
            try:
                tokens.append(bytes(byte_of[c] for c in tok))
            except KeyError:  # a token outside the byte alphabet decodes as its UTF-8
                tokens.append(tok.encode("utf-8"))
        else:
            m = _BYTE_TOKEN.match(tok)
            tokens.append(bytes([int(m.group(1), 16)]) if m
                          else tok.replace("\u2581", " ").encode("utf-8"))
        if not tokens[-1]:
            special_ids.append(i)
    eos = [t for t in tokenizer.eos_token_ids if 0 <= t < vocab_size]
    return Vocab(tokens, special_ids, eos)
