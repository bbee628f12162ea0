"""A GGUF's metadata header from the Hub, for a front end that tokenizes but runs no model.

The tokenizer of a GGUF lives in its key/value header (a few MB at the start of a file of
several GB), so the ingress fetches that part with HTTP range requests and keeps it as a small
.gguf file (the header only, no tensors) under HF_HOME/kvserve/gguf-headers/, where an offline
start finds it again. The tokenizer loader reads nothing past the key/value section.
"""

from __future__ import annotations

import os
import struct

from kvserve.errors import ModelLoadError

FIRST_READ = 1 << 20
MAX_HEADER = 1 << 30  # a header past this is not a tokenizer: refuse rather than fetch a model
# byte sizes of GGUF's scalar value types; 8 is a string, 9 an array
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def _header_path(repo_id: str, commit: str, filename: str) -> str:
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    return os.path.join(constants.HF_HOME, "kvserve", "gguf-headers",
                        repo_folder_name(repo_id=repo_id, repo_type="model"), commit, filename)


def cached_header(hub, commit: str, storage: str) -> str | None:
    path = _header_path(hub.repo_id, commit, hub.gguf_file)
    return path if os.path.isfile(path) else None


def gguf_header(hub, commit: str, storage: str) -> str:
    """Path of the header-only copy of `hub`'s GGUF at `commit`, fetched if not kept yet."""
    path = cached_header(hub, commit, storage)
    if path:
        return path
    from huggingface_hub import hf_hub_url

    url = hf_hub_url(hub.repo_id, hub.gguf_file, revision=commit)
    data = b""
    want = FIRST_READ
    while True:
        chunk = _get_range(hub, url, len(data), len(data) + want)
        data += chunk
        end = metadata_end(data)
        if end is not None:
            break
        if len(chunk) < want:
            raise ModelLoadError(f"{hub}: the GGUF file ends inside its metadata header")
        if len(data) >= MAX_HEADER:
            raise ModelLoadError(f"{hub}: the GGUF metadata header is larger than 1 GiB")
        want = len(data)  # double what is held
    path = _header_path(hub.repo_id, commit, hub.gguf_file)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data[:end])
        os.replace(tmp, path)
    except OSError as e:
        raise ModelLoadError(f"{hub}: cannot keep the GGUF header at {path}: {e}") from None
    return path


def _get_range(hub, url: str, start: int, stop: int) -> bytes:
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_backoff

    headers = {**build_hf_headers(), "range": f"bytes={start}-{stop - 1}"}
    try:
        r = http_backoff("GET", url, headers=headers)
        hf_raise_for_status(r)
    except Exception as e:
        raise ModelLoadError(f"{hub}: reading the GGUF header failed: {type(e).__name__}: "
                             f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from None
    if r.status_code == 200 and start:  # the server ignored the range: it sent the whole file
        return r.content[start:stop]
    return r.content[: stop - start]


def metadata_end(data: bytes) -> int | None:
    """Offset where `data`'s GGUF key/value section ends; None when `data` stops before it."""
    if len(data) < 24:
        return None
    if data[:4] != b"GGUF":
        raise ModelLoadError(f"not a GGUF file (starts with {data[:4]!r})")
    endian = "<" if struct.unpack_from("<I", data, 4)[0] <= 0xFFFF else ">"
    n_kv = struct.unpack_from(endian + "Q", data, 16)[0]
    pos = 24
    try:
        for _ in range(n_kv):
            pos = _skip_string(data, pos, endian)
            (kind,) = struct.unpack_from(endian + "I", data, pos)
            pos = _skip_value(data, pos + 4, kind, endian)
    except (struct.error, _Short):
        return None
    return pos if pos <= len(data) else None


class _Short(Exception):
    pass


def _skip_string(data: bytes, pos: int, endian: str) -> int:
    (n,) = struct.unpack_from(endian + "Q", data, pos)
    pos += 8 + n
    if pos > len(data):
        raise _Short
    return pos


def _skip_value(data: bytes, pos: int, kind: int, endian: str) -> int:
    if kind in _SCALAR:
        pos += _SCALAR[kind]
    elif kind == _STRING:
        pos = _skip_string(data, pos, endian)
    elif kind == _ARRAY:
        item, count = struct.unpack_from(endian + "IQ", data, pos)
        pos += 12
        if item in _SCALAR:
            pos += _SCALAR[item] * count
        else:
            for _ in range(count):
                pos = _skip_value(data, pos, item, endian)
    else:
        raise ModelLoadError(f"unknown GGUF value type {kind} in the metadata header")
    if pos > len(data):
        raise _Short
    return pos
