"""Parsers of the tool-call formats models are tuned on, one module per format; `for_template`
picks the one a chat template uses."""

from __future__ import annotations

from collections.abc import Mapping

from kvserve.tools.parsers.base import ToolParser
from kvserve.tools.parsers.hermes import HermesParser
from kvserve.tools.parsers.llama3 import Llama3JsonParser
from kvserve.tools.parsers.mistral import MistralParser

__all__ = ["SPELLED", "HermesParser", "Llama3JsonParser", "MistralParser", "ToolParser",
           "for_template"]

# markers a constrained call format writes: where they are special tokens, the grammar
# engine's vocabulary gives them bytes of their own (`kvserve.workers.structured.vocab`)
SPELLED = tuple(dict.fromkeys(m for p in (HermesParser, Llama3JsonParser, MistralParser)
                              for m in p.spelled))


def for_template(template: str | None, tokens: Mapping[str, int] | None = None) -> ToolParser:
    """The parser of the call format `template` renders tools for. A template with no tools
    section gets kvserve's default tools prompt, which asks for Hermes-style blocks. `tokens`:
    the tokenizer's special tokens among `SPELLED`, by text."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return MistralParser(args_format="[ARGS]" in t, tokens=tokens)
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and "tools" in t):
        return Llama3JsonParser(tokens)
    return HermesParser(tokens)
