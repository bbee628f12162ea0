"""Request size limits of the HTTP front end (413 with an OpenAI error body).

A body larger than `max_request_bytes` is refused before it is parsed or tokenized: by its
Content-Length when it has one, else while it is read (chunked uploads). The limit lives in
this importable module, as the API keys do in auth.py: Serve pickles the app by value.
"""

from __future__ import annotations

from typing import Any

from starlette.exceptions import HTTPException

from kvserve.deploy.errors import ServiceError

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024

_max_bytes = DEFAULT_MAX_REQUEST_BYTES


def set_max_request_bytes(n: int) -> None:
    global _max_bytes
    _max_bytes = int(n)


def too_large(limit: int) -> ServiceError:
    return ServiceError("too_large", f"request body is larger than the server's limit of "
                                     f"{limit} bytes (max_request_bytes)")


class BodyTooLarge(HTTPException):
    """Raised from `receive` mid-read; an HTTPException so FastAPI passes it on unchanged
    (it turns other errors while reading a body into a generic 400)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, too_large(limit).message)
        self.limit = limit


class BodyLimit:
    """ASGI middleware: 413 for request bodies over the limit."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = _max_bytes
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _send_error(send, too_large(limit))
            return
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return msg

        await self.app(scope, counted, send)


async def _send_error(send: Any, e: ServiceError) -> None:
    import json

    body = json.dumps(e.openai_body()).encode()
    await send({"type": "http.response.start", "status": e.http_status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
