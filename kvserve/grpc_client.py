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


def stream_generate(
    server: str, prompt: str, params: dict[str, Any], api_key: str | None = None,
    session_id: str | None = None, timeout: float | None = None,
) -> Iterator[Any]:
    """Yield GenerateStreamResponse chunks of one request."""
    import grpc

    from kvserve.protos import kvserve_pb2 as pb
    from kvserve.protos import kvserve_pb2_grpc

    md = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    req = pb.GenerateRequest(prompt=prompt, sampling=_sampling(params))
    if session_id:
        req.session_id = session_id
    with grpc.insecure_channel(server) as ch:
        stub = kvserve_pb2_grpc.KVServeStub(ch)
        yield from stub.GenerateStream(req, metadata=md, timeout=timeout)


def cmd_generate_remote(a: Any, params: dict[str, Any]) -> int:
    """Print the text as it streams; the usage and serving worker go to stderr."""
    import grpc

    last = None
    try:
        for chunk in stream_generate(a.server, a.prompt, params, a.api_key, a.session_id):
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
