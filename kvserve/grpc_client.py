"""A small gRPC client of a running kvserve server (`kvserve generate --server HOST:PORT`)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any


def _sampling(params: dict[str, Any]) -> Any:
    from kvserve.protos import kvserve_pb2 as pb

    fields = {k: v for k, v in params.items() if v is not None and v != [] and v is not False}
    structured = fields.pop("structured", None)
    if structured is not None:
        fields["response_format"] = response_format(structured)
    return pb.SamplingParams(**fields)


def response_format(structured: Any) -> Any:
    """A StructuredOutput (or its dict) as the gRPC ResponseFormat message."""
    from kvserve.protos import kvserve_pb2 as pb
    from kvserve.structured import StructuredOutput

    s = StructuredOutput.model_validate(structured)
    if s.type == "json_object":
        return pb.ResponseFormat(json_object=pb.JsonObject())
    if s.type == "json_schema":
        return pb.ResponseFormat(json_schema=pb.JsonSchema(schema=s.spec, strict=s.strict))
    if s.type == "regex":
        return pb.ResponseFormat(regex=s.spec)
    if s.type == "structural_tag":  # built by the server from a request's tools, not sent
        raise ValueError("a structural_tag is not a response_format; send the tools instead")
    return pb.ResponseFormat(grammar=s.spec)


def channel_credentials(ca: str | None = None, cert: str | None = None,
                        key: str | None = None) -> Any:
    """TLS credentials of a channel: the server verified with `ca` (default: the system's
    CAs), and a client certificate with its key for a server that requires one."""
    import grpc

    from kvserve.errors import ConfigError

    if bool(cert) != bool(key):
        raise ConfigError("--cert and --key go together: a client certificate and its key")

    def read(path: str | None, flag: str) -> bytes | None:
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise ConfigError(f"{flag} {path}: {e.strerror or e}") from None

    return grpc.ssl_channel_credentials(root_certificates=read(ca, "--ca"),
                                        private_key=read(key, "--key"),
                                        certificate_chain=read(cert, "--cert"))


def open_channel(server: str, credentials: Any = None) -> Any:
    """A channel to `server`: TLS with `credentials` (channel_credentials), else plaintext."""
    import grpc

    if credentials is None:
        return grpc.insecure_channel(server)
    return grpc.secure_channel(server, credentials)


def stream_generate(
    server: str, prompt: str, params: dict[str, Any], api_key: str | None = None,
    session_id: str | None = None, timeout: float | None = None, credentials: Any = None,
) -> Iterator[Any]:
    """Yield GenerateStreamResponse chunks of one request (over TLS with `credentials`)."""
    from kvserve.protos import kvserve_pb2 as pb
    from kvserve.protos import kvserve_pb2_grpc

    md = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    req = pb.GenerateRequest(prompt=prompt, sampling=_sampling(params))
    if session_id:
        req.session_id = session_id
    with open_channel(server, credentials) as ch:
        stub = kvserve_pb2_grpc.KVServeStub(ch)
        yield from stub.GenerateStream(req, metadata=md, timeout=timeout)


def cmd_generate_remote(a: Any, params: dict[str, Any]) -> int:
    """Print the text as it streams; the usage and serving worker go to stderr."""
    import grpc

    creds = None
    if a.tls or a.ca or a.cert or a.key:
        creds = channel_credentials(a.ca, a.cert, a.key)
    last = None
    try:
        for chunk in stream_generate(a.server, a.prompt, params, a.api_key, a.session_id,
                                     credentials=creds):
            sys.stdout.write(chunk.delta_text)
            sys.stdout.flush()
            last = chunk
    except grpc.RpcError as e:
        print(f"\nkvserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    if last is not None:
        u = last.usage
        print(f"[{last.finish_reason}; {u.prompt_tokens} prompt ({u.cached_tokens} cached) + "
              f"{u.completion_tokens} completion tokens; served by {last.worker_id}]",
              file=sys.stderr)
    return 0
