"""Speculative decoding through the whole service, on real Ray with real gRPC and HTTP clients.

An app of its own (its own router and one worker whose engine speculates with n-gram
proposals, beside the session's shared app, on the same Serve proxies):

- greedy output over gRPC, and every choice of an OpenAI request with `n` = 2, is the plain
  (non-speculating) engine's output, and the worker's stats in GetServerInfo show the
  speculation policy's decisions, drafts and accepted tokens;
- a seeded sampled request with `n` = 2 is reproducible choice by choice, and each choice is
  what a single request with that choice's seed gives;
- a stop string inside a copied span ends the text where it starts.

The heavy tier: the app loads the model into a new worker.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import ray
import requests
from serve_fixtures import API_KEY

from kvserve.deploy.app import build_app
from kvserve.deploy.config import ServeConfig
from kvserve.protos import kvserve_pb2 as pb
from kvserve.protos import kvserve_pb2_grpc
from kvserve.router.lifecycle import kill_router
from kvserve.router.router import NAMESPACE
from kvserve.sampling import SamplingParams

pytestmark = pytest.mark.slow

APP = "kvserve-spec"
ENGINE = {"num_threads": 1, "kv_cache_tokens": 2048, "max_model_len": 512, "max_num_seqs": 8}
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}
# copy-heavy: the model continues the list, and the n-gram lookup finds what it copies
PROMPT = ("Repeat the list exactly.\nList: red fox, blue whale, green frog, yellow bee, "
          "red fox, blue whale, green frog, yellow bee,\nList: red fox, blue whale,")
MAX_TOKENS = 24


@dataclass
class App:
    router: Any
    grpc_target: str
    http_url: str  # the app's prefix included

    @property
    def md(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {API_KEY}"), ("application", APP))

    def stub(self) -> Any:
        return kvserve_pb2_grpc.KVServeStub(grpc.insecure_channel(self.grpc_target))

    def completions(self, **body: Any) -> dict[str, Any]:
        r = requests.post(f"{self.http_url}/v1/completions", timeout=600,
                          headers={"authorization": f"Bearer {API_KEY}"},
                          json={"model": "default", "prompt": PROMPT, **body})
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module")
def app(serve_app) -> Iterator[App]:
    from ray import serve

    router_name = "kvserve-router-spec"
    cfg = ServeConfig(num_workers=1, num_cpus_per_worker=0.5, engine=ENGINE,
                      api_keys=[API_KEY], grpc_port=serve_app.grpc_port,
                      http_port=serve_app.http_port, router_name=router_name,
                      speculative_config=SPEC)
    serve.run(build_app(cfg), name=APP, route_prefix=f"/{APP}")
    try:
        yield App(ray.get_actor(router_name, namespace=NAMESPACE), serve_app.grpc_target,
                  f"{serve_app.http_url}/{APP}")
    finally:
        with contextlib.suppress(Exception):
            serve.delete(APP)
        kill_router(router_name)


def _stats(app: App) -> dict[str, float]:
    info = app.stub().GetServerInfo(pb.GetServerInfoRequest(), metadata=app.md, timeout=60)
    (w,) = info.workers
    return dict(w.stats)


def _decided(s: dict[str, float]) -> float:
    """Steps whose speculation the worker's policy decided: verified, or not worth it."""
    return s.get("spec_steps", 0.0) + s.get("spec_steps_off_cost", 0.0) \
        + s.get("spec_steps_off_batch", 0.0)


def _stats_after(app: App, before: dict[str, float]) -> dict[str, float]:
    """The worker's stats once the router's poll shows the steps run since `before`."""
    deadline = time.monotonic() + 120
    while _decided(s := _stats(app)) <= _decided(before):
        assert time.monotonic() < deadline, s
        time.sleep(0.25)
    return s


def test_greedy_output_and_every_choice_match_plain_decoding(app, smol_llm):
    plain = smol_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                     ignore_eos=True))[0]
    before = _stats(app)
    r = app.stub().Generate(pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)), metadata=app.md, timeout=600)
    assert list(r.token_ids) == plain.token_ids
    got = app.completions(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert [c["text"] for c in got["choices"]] == [plain.text, plain.text]
    assert got["usage"]["completion_tokens"] == 2 * MAX_TOKENS
    after = _stats_after(app, before)
    # the speculating engine decided each step: verify proposals, or decode plainly where
    # its measured costs say verifying would not pay (so how many verified depends on the
    # host); whatever it verified, it accepted at most what was proposed
    assert after["spec_draft_tokens"] >= after["spec_accepted_tokens"]
    assert after["spec_draft_tokens"] >= after["spec_drafts"]
    if after["spec_drafts"] > 0:
        assert after["spec_mean_accepted_length"] >= 1.0


def test_seeded_sampled_choices_are_reproducible(app):
    body = {"temperature": 0.8, "top_p": 0.95, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    first = app.completions(n=2, seed=7, **body)
    again = app.completions(n=2, seed=7, **body)
    texts = [c["text"] for c in first["choices"]]
    assert texts == [c["text"] for c in again["choices"]]
    # choice i runs with seed + i (the front end's fan-out), as a single request would
    assert [app.completions(seed=s, **body)["choices"][0]["text"] for s in (7, 8)] == texts


def test_a_stop_string_inside_a_copied_span_ends_the_text(app, smol_llm):
    plain = smol_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                     ignore_eos=True))[0].text
    # a stop string the greedy text reaches after a few copied words
    stop = plain.strip().split(",")[1].strip()
    assert stop, plain
    got = app.completions(temperature=0, max_tokens=MAX_TOKENS, stop=[stop])["choices"][0]
    assert got["finish_reason"] == "stop"
    assert got["text"] == plain[:plain.index(stop)]
