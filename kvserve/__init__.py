"""kvserve: LLM serving on Ray with per-stream paged KV caches.

The core (config, sampling, outputs, errors, models, hardware) imports no other kvserve part;
the front doors (`llm`, `cli`, `grpc_client`, `bench/`) may import any. Heavy parts load lazily.
"""

from __future__ import annotations

import os as _os

# In a source checkout that is not installed, the subpackages live in top-level
# folders beside this one (kvcache/, workers/, ...). Adding the checkout root to
# this package's search path makes `kvserve.kvcache` resolve there too; an
# installed copy has them nested already and is unaffected.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isdir(_os.path.join(_root, "kvcache")) and _root not in __path__:
    __path__.append(_root)

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "default_model"]


def __getattr__(name: str):
    if name == "LLM":
        from kvserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvserve.sampling import SamplingParams

        return SamplingParams
    if name == "EngineConfig":
        from kvserve.config import EngineConfig

        return EngineConfig
    if name == "RequestOutput":
        from kvserve.outputs import RequestOutput

        return RequestOutput
    if name == "default_model":
        from kvserve.models import default_model

        return default_model
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
