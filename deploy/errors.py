"""Client-facing errors: one kind each, with its gRPC status and HTTP status."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc


class ServiceError(Exception):
    """An error the client should see, with a clear message."""

    # kind -> (gRPC status, HTTP status, OpenAI error type)
    KINDS: dict[str, tuple[grpc.StatusCode, int, str]] = {
        "invalid": (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
        "not_found": (grpc.StatusCode.NOT_FOUND, 404, "not_found_error"),
        "conflict": (grpc.StatusCode.FAILED_PRECONDITION, 409, "conflict_error"),
        "unauthenticated": (grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error"),
        "overloaded": (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
        "too_large": (grpc.StatusCode.RESOURCE_EXHAUSTED, 413, "invalid_request_error"),
        "unavailable": (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable"),
        "internal": (grpc.StatusCode.INTERNAL, 500, "internal_error"),
    }

    def __init__(self, kind: str, message: str, retry_after: int | None = None) -> None:
        if kind not in self.KINDS:
            kind = "internal"
        super().__init__(message)
        self.kind = kind
        self.message = message
        # seconds after which a retry should find the service able to serve: HTTP's
        # Retry-After (Serve's gRPC proxy sends no trailing metadata with an error status, so
        # on gRPC the message names it); set where the request already waited
        self.retry_after = retry_after
        # the base model whose request it answers (its rejection's `model` tag); None: the
        # service's first model
        self.model: str | None = None

    def __reduce__(self) -> tuple:  # picklable: Ray ships it from the replica to the proxy
        return (ServiceError, (self.kind, self.message, self.retry_after))

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(int(self.retry_after))}

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return self.KINDS[self.kind][0]

    @property
    def http_status(self) -> int:
        return self.KINDS[self.kind][1]

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.KINDS[self.kind][2],
                          "code": self.http_status}}


@contextmanager
def for_model(model: str) -> Iterator[None]:
    """ServiceErrors raised in the block answer a request to `model` (metrics tag them so)."""
    try:
        yield
    except ServiceError as e:
        if e.model is None:
            e.model = model
        raise
