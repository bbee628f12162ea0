"""Models by Hugging Face Hub name: `org/name`, `org/name@revision`, `org/name:file.gguf[@rev]`.

The files are fetched with huggingface_hub into its own cache (HF_HOME / HF_HUB_CACHE), so other
tools share them; only what the engine reads is fetched (config, tokenizer, chat template, the
safetensors weights; or the one GGUF file). A revision that is a commit hash and is complete in
the cache is used without asking the Hub; a branch or tag is looked up (the cached copy is used
when the Hub cannot be reached); HF_HUB_OFFLINE=1 never asks. Every failure is a one-line
ModelLoadError.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvserve.errors import ModelLoadError
from kvserve.hub_progress import DownloadProgress, FileToFetch, ProgressPoller

log = logging.getLogger(__name__)

# org/name, then optionally :path/to/file.gguf, then optionally @revision
_HUB_ID = re.compile(
    r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<file>[^@:]+\.gguf))?(?:@(?P<rev>[^@:]+))?$",
    re.IGNORECASE,
)
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
# what the tokenizer loader reads (tokenizer.py): the ingress fetches only these
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "chat_template.json", "generation_config.json", "config.json",
)
_EXTRA_TEMPLATES = re.compile(r"^additional_chat_templates/[^/]+\.jinja$")
# the weight files hf_loader.py reads, best first: an index names its shards
_WEIGHTS = ("model.safetensors.index.json", "model.safetensors",
            "pytorch_model.bin.index.json", "pytorch_model.bin")
MAX_PARALLEL_FILES = 8


@dataclass(frozen=True)
class HubModel:
    repo_id: str
    revision: str | None = None  # None: the default branch
    gguf_file: str | None = None

    @property
    def rev(self) -> str:
        return self.revision or "main"

    def __str__(self) -> str:
        file = f":{self.gguf_file}" if self.gguf_file else ""
        rev = f"@{self.revision}" if self.revision else ""
        return f"{self.repo_id}{file}{rev}"

    @property
    def served_name(self) -> str:
        """The name clients use: the repository id, or the GGUF file's stem."""
        if self.gguf_file:
            return os.path.basename(self.gguf_file)[: -len(".gguf")]
        return self.repo_id


def parse_hub_id(model: str) -> HubModel | None:
    """The Hub model `model` names, or None when it is not in that form (then it is a path)."""
    m = _HUB_ID.match(model)
    if m is None or m["repo"].lower().endswith(".gguf"):
        return None  # "dir/file.gguf" is a local path that does not exist
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(m["repo"])
    except HFValidationError as e:
        raise ModelLoadError(f"{model}: not a file, and not a valid Hub repository id ({e})") from None
    return HubModel(m["repo"], m["rev"], m["file"])


def fetch(hub: HubModel, tokenizer_only: bool = False,
          progress: Callable[[DownloadProgress], None] | None = None) -> str:
    """Local path of the model (a snapshot folder or a .gguf file), fetched if needed.

    `tokenizer_only`: only what tokenizing needs (the ingress): the tokenizer and config files,
    or a GGUF's metadata header. `progress` hears the bytes fetched while files download."""
    from huggingface_hub import constants

    storage = _storage(hub)
    offline = constants.HF_HUB_OFFLINE
    if offline or _COMMIT.match(hub.rev):  # nothing to look up: a commit never changes
        found, missing = _cached(storage, hub, hub.rev, tokenizer_only)
        if found:
            return found
        if offline:
            raise ModelLoadError(_offline_miss(hub, storage, missing))
    try:
        info = _model_info(hub)
    except _Unreachable as e:
        found, missing = _cached(storage, hub, hub.rev, tokenizer_only)
        if found:
            log.warning("%s: %s; using the cached copy", hub, e)
            return found
        cached = f" (the cached copy lacks {', '.join(missing)})" if missing else ""
        raise ModelLoadError(
            f"{hub}: cannot reach the Hugging Face Hub at {constants.ENDPOINT} ({e}) and the model "
            f"is not in the cache at {constants.HF_HUB_CACHE}{cached}; check the network, "
            "HF_ENDPOINT or a proxy, or fill the cache elsewhere and set HF_HUB_OFFLINE=1"
        ) from None
    sha = info.sha
    files = {s.rfilename: s for s in info.siblings or []}
    _remember_revision(storage, hub.rev, sha)
    if hub.gguf_file:
        if hub.gguf_file not in files:
            raise ModelLoadError(_no_such_file(hub, sha, files))
        if tokenizer_only:
            from kvserve.hub_gguf import gguf_header

            cached = os.path.join(storage, "snapshots", sha, hub.gguf_file)
            return cached if os.path.isfile(cached) else gguf_header(hub, sha, storage)
        _download(hub, sha, storage, [files[hub.gguf_file]], progress)
        return os.path.join(storage, "snapshots", sha, hub.gguf_file)
    small = [files[f] for f in TOKENIZER_FILES if f in files]
    small += [s for f, s in files.items() if _EXTRA_TEMPLATES.match(f)]
    if "tokenizer.json" not in files:
        raise ModelLoadError(
            f"{hub}: the repository has no tokenizer.json (kvserve reads the tokenizer from it)"
            + _gguf_hint(files))
    if not tokenizer_only and "config.json" not in files:
        raise ModelLoadError(f"{hub}: the repository has no config.json" + _gguf_hint(files))
    weights = [] if tokenizer_only else _weight_files(hub, files)
    index = [s for s in weights if s.rfilename.endswith(".index.json")]
    # small files and the index first: weights complete in the cache imply the rest is there
    _download(hub, sha, storage, small + index, None)
    if index:
        shards = _shards(os.path.join(storage, "snapshots", sha, index[0].rfilename), hub, files)
        weights = shards
    if weights:
        _download(hub, sha, storage, weights, progress)
    return os.path.join(storage, "snapshots", sha)


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def fetch_adapter(hub: HubModel) -> str:
    """The local snapshot folder of a PEFT LoRA adapter repository (its config and
    safetensors weights), fetched if needed; ModelLoadError as `fetch`."""
    from huggingface_hub import constants

    storage = _storage(hub)

    def cached() -> str | None:
        commit = hub.rev if _COMMIT.match(hub.rev) else _read(os.path.join(storage, "refs", hub.rev))
        snap = os.path.join(storage, "snapshots", commit or "-")
        ok = commit and all(os.path.isfile(os.path.join(snap, f)) for f in ADAPTER_FILES)
        return snap if ok else None

    if constants.HF_HUB_OFFLINE or _COMMIT.match(hub.rev):
        found = cached()
        if found:
            return found
        if constants.HF_HUB_OFFLINE:
            raise ModelLoadError(f"{hub}: the LoRA adapter is not in the cache at {storage} and "
                                 "HF_HUB_OFFLINE=1 forbids fetching it")
    try:
        info = _model_info(hub)
    except _Unreachable as e:
        found = cached()
        if found:
            return found
        raise ModelLoadError(f"{hub}: cannot reach the Hugging Face Hub ({e}) and the LoRA "
                             "adapter is not cached") from None
    files = {s.rfilename: s for s in info.siblings or []}
    missing = [f for f in ADAPTER_FILES if f not in files]
    if missing:
        raise ModelLoadError(f"{hub}: not a PEFT LoRA adapter repository (no "
                             f"{', '.join(missing)})")
    _remember_revision(storage, hub.rev, info.sha)
    _download(hub, info.sha, storage, [files[f] for f in ADAPTER_FILES], None)
    return os.path.join(storage, "snapshots", info.sha)


# ---- the cache -----------------------------------------------------------------------------


def _storage(hub: HubModel) -> str:
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return os.path.join(constants.HF_HUB_CACHE, repo_folder_name(repo_id=hub.repo_id,
                                                                 repo_type="model"))


def _cached(storage: str, hub: HubModel, rev: str, tokenizer_only: bool
            ) -> tuple[str | None, list[str]]:
    """(the complete cached copy of `rev`, or None; the files it lacks when partly cached)."""
    commit = rev if _COMMIT.match(rev) else _read(os.path.join(storage, "refs", rev))
    if not commit:
        return None, []
    snap = os.path.join(storage, "snapshots", commit)
    if not os.path.isdir(snap):
        return None, []
    if hub.gguf_file:
        path = os.path.join(snap, hub.gguf_file)
        if os.path.isfile(path):
            return path, []
        if tokenizer_only:
            from kvserve.hub_gguf import cached_header

            header = cached_header(hub, commit, storage)
            if header:
                return header, []
        return None, [hub.gguf_file]
    missing = [f for f in ("tokenizer.json",) + (() if tokenizer_only else ("config.json",))
               if not os.path.isfile(os.path.join(snap, f))]
    if not tokenizer_only:
        missing += _missing_weights(snap)
    return (None, missing) if missing else (snap, [])


def _missing_weights(snap: str) -> list[str]:
    for name in _WEIGHTS:
        path = os.path.join(snap, name)
        if not os.path.isfile(path):
            continue
        if not name.endswith(".index.json"):
            return []
        try:
            with open(path, encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return [name]
        return [s for s in shards if not os.path.isfile(os.path.join(snap, s))]
    return ["the weights (" + ", ".join(_WEIGHTS) + ")"]


def _remember_revision(storage: str, rev: str, sha: str) -> None:
    """refs/<branch> -> commit, as huggingface_hub keeps it: an offline start finds it there."""
    if rev == sha:
        return
    path = os.path.join(storage, "refs", rev)
    if _read(path) == sha:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(sha)
        os.replace(tmp, path)
    except OSError as e:
        raise ModelLoadError(f"cannot write the Hugging Face cache at {storage}: {e}") from None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


# ---- the Hub -------------------------------------------------------------------------------


class _Unreachable(Exception):
    """The Hub did not answer (no connection, timeout, a 5xx): a cached copy may still do."""


def _model_info(hub: HubModel) -> Any:
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    # the Hub's metadata timeout (HF_HUB_ETAG_TIMEOUT): a silent network fails in seconds
    timeout = float(getattr(constants, "HF_HUB_ETAG_TIMEOUT", 10))
    try:
        return HfApi().model_info(hub.repo_id, revision=hub.rev, files_metadata=True,
                                  timeout=timeout)
    except GatedRepoError:
        raise ModelLoadError(_gated(hub)) from None
    except RevisionNotFoundError:
        raise ModelLoadError(
            f"{hub}: the repository {hub.repo_id} has no revision {hub.rev!r} (a branch, tag or "
            "commit hash)") from None
    except RepositoryNotFoundError:
        token = "" if _token() else "; if it is private, set HF_TOKEN"
        raise ModelLoadError(
            f"{hub}: no model repository {hub.repo_id!r} on the Hub{token} (and no local file or "
            f"directory {str(hub)!r})") from None
    except OfflineModeIsEnabled as e:
        raise _Unreachable(f"offline mode: {e}") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        if status in (401, 403):
            raise ModelLoadError(
                f"{hub}: the Hub refused access (HTTP {status}); check HF_TOKEN") from None
        raise _Unreachable(f"HTTP {status}") from None
    except Exception as e:  # connection refused, DNS, TLS, timeouts (httpx's or requests')
        raise _Unreachable(f"{type(e).__name__}: {_first_line(e)}") from None


def _download(hub: HubModel, sha: str, storage: str, files: list[Any],
              progress: Callable[[DownloadProgress], None] | None) -> None:
    """hf_hub_download each file at the commit (in parallel): huggingface_hub skips cached ones,
    locks against other processes fetching the same blob, and resumes a broken transfer."""
    from huggingface_hub import hf_hub_download

    if not files:
        return
    todo = [FileToFetch(s.rfilename, s.size or 0, s.lfs.sha256 if s.lfs else s.blob_id)
            for s in files]
    poller = ProgressPoller(str(hub), os.path.join(storage, "snapshots", sha), storage, todo,
                            progress) if progress else None

    def one(f: FileToFetch) -> None:
        try:
            hf_hub_download(hub.repo_id, f.name, revision=sha)
        except Exception as e:
            raise ModelLoadError(_download_error(hub, f.name, e)) from None

    try:
        if poller:
            poller.start()
        pool = ThreadPoolExecutor(min(MAX_PARALLEL_FILES, len(todo)))
        try:
            for future in [pool.submit(one, f) for f in todo]:
                future.result()
        finally:  # a signal (KeyboardInterrupt) does not wait for the transfers under way
            pool.shutdown(wait=False, cancel_futures=True)
    finally:
        if poller:
            poller.stop()


def _download_error(hub: HubModel, name: str, e: Exception) -> str:
    from huggingface_hub import constants
    from huggingface_hub.errors import EntryNotFoundError, GatedRepoError, LocalEntryNotFoundError

    if isinstance(e, GatedRepoError):
        return _gated(hub)
    if isinstance(e, LocalEntryNotFoundError):  # the connection went away between the calls
        return f"{hub}: cannot reach the Hugging Face Hub at {constants.ENDPOINT} to fetch {name}"
    if isinstance(e, EntryNotFoundError):
        return f"{hub}: the repository has no file {name!r}"
    return f"{hub}: fetching {name} failed: {type(e).__name__}: {_first_line(e)}"


# ---- which files ---------------------------------------------------------------------------


def _weight_files(hub: HubModel, files: dict[str, Any]) -> list[Any]:
    for name in _WEIGHTS:
        if name in files:
            return [files[name]]
    raise ModelLoadError(
        f"{hub}: the repository has no weights kvserve reads ({', '.join(_WEIGHTS)})"
        + _gguf_hint(files))


def _shards(index_path: str, hub: HubModel, files: dict[str, Any]) -> list[Any]:
    try:
        with open(index_path, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelLoadError(f"{hub}: cannot read {os.path.basename(index_path)}: {e}") from None
    missing = [n for n in names if n not in files]
    if missing:
        raise ModelLoadError(
            f"{hub}: {os.path.basename(index_path)} names shards the repository lacks: "
            + ", ".join(missing[:3]))
    return [files[n] for n in names]


def _gguf_hint(files: dict[str, Any]) -> str:
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    if not ggufs:
        return ""
    more = f" (and {len(ggufs) - 5} more)" if len(ggufs) > 5 else ""
    return f"; it has GGUF files: name one as ORG/NAME:FILE.gguf ({', '.join(ggufs[:5])}{more})"


def _no_such_file(hub: HubModel, sha: str, files: dict[str, Any]) -> str:
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    there = f"; its GGUF files: {', '.join(ggufs[:8])}" if ggufs else "; it has no GGUF files"
    return f"{hub}: the repository has no file {hub.gguf_file!r} at {sha[:12]}{there}"


# ---- messages --------------------------------------------------------------------------------


def _token() -> str | None:
    from huggingface_hub import get_token

    return get_token()


def _gated(hub: HubModel) -> str:
    if _token():
        return (f"{hub}: the repository is gated and the token in HF_TOKEN has no access; accept "
                f"its terms on the Hub page of {hub.repo_id} with that account")
    return (f"{hub}: the repository is gated: accept its terms on the Hub page of {hub.repo_id} "
            "and set HF_TOKEN to a token of that account")


def _offline_miss(hub: HubModel, storage: str, missing: list[str]) -> str:
    from huggingface_hub import constants

    if missing:
        return (f"{hub}: the cached copy in {storage} lacks {', '.join(missing[:3])} and "
                "HF_HUB_OFFLINE=1 forbids fetching it; run once with network access")
    return (f"{hub}: not in the Hugging Face cache at {constants.HF_HUB_CACHE} and "
            "HF_HUB_OFFLINE=1 forbids downloading it; run once with network access "
            "(or set HF_HOME / HF_HUB_CACHE to the cache that has it)")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
