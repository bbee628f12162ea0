"""Parsers of the tool-call formats models are tuned on, one module per format; `for_template`
picks the one a chat template uses."""

from __future__ import annotations

from kvserve.tools.parsers.base import ToolParser
from kvserve.tools.parsers.hermes import HermesParser
from kvserve.tools.parsers.llama3 import Llama3JsonParser
from kvserve.tools.parsers.mistral import MistralParser

__all__ = ["HermesParser", "Llama3JsonParser", "MistralParser", "ToolParser", "for_template"]


def for_template(template: str | None) -> ToolParser:
    """The parser of the call format `template` renders tools for. A template with no tools
    section gets kvserve's default tools prompt, which asks for Hermes-style blocks."""
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return MistralParser()
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and "tools" in t):
        return Llama3JsonParser()
    return HermesParser()
