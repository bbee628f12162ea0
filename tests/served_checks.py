"""Greedy-text checks of a served app against the offline engine on the same device, shared
by the CPU app's tests (`deploy/test_serve_api.py`) and the GPU worker's
(`deploy/test_serve_gpu.py`)."""

from __future__ import annotations

from typing import Any

import openai

from kvserve.protos import kvserve_pb2 as pb
from kvserve.sampling import SamplingParams

PROMPT = "The three primary colors are"
MAX_TOKENS = 12
CHAT = [{"role": "user", "content": "Name a fruit."}]


def offline_texts(llm: Any) -> dict[str, str]:
    p = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return {"text": llm.generate([PROMPT], p)[0].text, "chat": llm.chat(CHAT, p)[0].text}


def greedy(n: int = MAX_TOKENS) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0, max_tokens=n)


def check_grpc_greedy(app: Any, stub: Any, offline: dict[str, str], device: str) -> None:
    """Unary and streamed Generate and Chat give the offline texts, from a worker on
    `device`."""
    md = app.metadata
    assert app.server_info()["model_info"]["device"] == device
    r = stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=greedy()), metadata=md)
    assert r.text == offline["text"]
    assert r.finish_reason in ("length", "stop") and r.worker_id.startswith("worker-")
    assert r.usage.completion_tokens == len(r.token_ids) > 0
    assert r.usage.prompt_tokens > 0 and r.model

    chunks = list(stub.GenerateStream(pb.GenerateRequest(prompt=PROMPT, sampling=greedy()),
                                      metadata=md))
    assert "".join(c.delta_text for c in chunks) == offline["text"]
    assert [t for c in chunks for t in c.delta_token_ids] == list(r.token_ids)
    assert all(not c.finish_reason for c in chunks[:-1]) and chunks[-1].finish_reason
    assert chunks[-1].usage.completion_tokens == len(r.token_ids)

    req = pb.ChatRequest(messages=[pb.ChatMessage(**CHAT[0])], sampling=greedy())
    assert stub.Chat(req, metadata=md).text == offline["chat"]
    assert "".join(c.delta_text for c in stub.ChatStream(req, metadata=md)) == offline["chat"]


def check_http_greedy(app: Any, offline: dict[str, str]) -> None:
    """The openai SDK's streamed and plain completions and streamed chat give the offline
    texts."""
    client = openai.OpenAI(base_url=app.http_url + "/v1", api_key=app.api_key, max_retries=0,
                           timeout=120)
    model = client.models.list().data[0].id
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True)
    parts = [c.choices[0].text for c in stream if c.choices]
    assert "".join(parts) == offline["text"] and len(parts) > 1

    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == offline["text"] and r.usage.completion_tokens > 0

    chat = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(chat)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == offline["chat"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
