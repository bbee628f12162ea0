"""API-key check of the HTTP front end, as state of an importable module.

Serve pickles the FastAPI app and the ingress class by value, so a module global of the
ingress module would be copied, not shared; this module is imported (by reference) instead.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from typing import Any

from kvserve.deploy.errors import ServiceError

_keys: frozenset[str] = frozenset()


def set_keys(keys: frozenset[str]) -> None:
    global _keys
    _keys = frozenset(keys)


def key_matches(key: str, keys: Iterable[str]) -> bool:
    """Whether `key` is one of `keys`, in time independent of where they differ: every key
    is compared in full (hmac.compare_digest), so timing tells nothing about a key."""
    given = key.encode("utf-8", "surrogatepass")
    found = False
    for k in keys:
        found |= hmac.compare_digest(given, k.encode("utf-8", "surrogatepass"))
    return found


def bearer(headers: Any) -> str | None:
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return headers.get("x-api-key") or None


def http_auth_error(headers: Any) -> ServiceError | None:
    if not _keys:
        return None
    key = bearer(headers)
    if key and key_matches(key, _keys):
        return None
    msg = "invalid API key" if key else "missing API key (send 'Authorization: Bearer KEY')"
    return ServiceError("unauthenticated", msg)
