"""How many gRPC client cancels never reach kvserve (Serve's gRPC proxy drops some).

Serves the default model (2 CPU workers, as the tests do), then for each round opens two
streams with the router's in-flight limit at 1 (one per worker, then a third request shed
with RESOURCE_EXHAUSTED) and a third stream beside a request that clashes with its id, reads
each stream's first message and cancels it. A stream still running on a worker 10 s later
(it would need about 30 s to end) is a dropped cancel; the ingress's live slots tell
whether the ingress still serves it (Serve never passed the cancel on) or let it go (a
kvserve leak).

    .venv/bin/python scripts/grpc_cancel_probe.py --rounds 40
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from serve_fixtures import API_KEY, ENGINE, ServeApp, free_port  # noqa: E402

from kvserve.deploy.config import ServeConfig  # noqa: E402
from kvserve.deploy.serve_cli import deploy  # noqa: E402
from kvserve.protos import kvserve_pb2 as pb  # noqa: E402
from kvserve.protos import kvserve_pb2_grpc  # noqa: E402
from kvserve.router.router import NAMESPACE, ROUTER_NAME  # noqa: E402

MD = (("authorization", f"Bearer {API_KEY}"),)
LONG = pb.SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)
PROMPT = "Count from one to one thousand:"


def one_round(stub, router, rnd: int) -> list:
    calls = []
    old = ray.get(router.set_max_inflight_per_worker.remote(1))
    try:
        for _ in range(2):
            calls.append(stub.GenerateStream(pb.GenerateRequest(prompt=PROMPT, sampling=LONG),
                                             metadata=MD, timeout=300))
            next(calls[-1])
        try:
            stub.Generate(pb.GenerateRequest(prompt="hi"), metadata=MD, timeout=60)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
    finally:
        ray.get(router.set_max_inflight_per_worker.remote(old))
    rid = f"probe-{rnd}"
    calls.append(stub.GenerateStream(pb.GenerateRequest(
        prompt=PROMPT, sampling=LONG, request_id=rid, session_id=rid), metadata=MD, timeout=300))
    next(calls[-1])
    try:
        stub.Generate(pb.GenerateRequest(prompt="hi", request_id=rid, session_id=rid),
                      metadata=MD, timeout=60)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=40, help="3 cancelled streams per round")
    args = ap.parse_args()
    cfg = ServeConfig(num_workers=2, num_cpus_per_worker=1, engine=ENGINE, api_keys=[API_KEY],
                      grpc_port=free_port(), http_port=free_port(), max_imbalance=2)
    deploy(cfg, ray_init={"num_cpus": 4, "include_dashboard": False, "log_to_driver": False},
           start_timeout_s=900)
    router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    app = ServeApp(cfg.grpc_port, cfg.http_port, API_KEY, router, cfg)
    dropped = leaked = 0
    with grpc.insecure_channel(app.grpc_target) as ch:
        stub = kvserve_pb2_grpc.KVServeStub(ch)
        for rnd in range(args.rounds):
            for c in one_round(stub, router, rnd):
                c.cancel()
            if left := app.streams_left(settle_s=10):
                held = app.ingress_slots()
                if not isinstance(held, int):
                    raise RuntimeError(f"the ingress's slot count is {held}")
                dropped += min(left, held)
                leaked += max(0, left - held)
                print(f"round {rnd}: {left} stream(s) still running, ingress serves {held}",
                      flush=True)
                app.streams_left(settle_s=600)  # let them end before the next round
    print(f"{3 * args.rounds} cancels: {dropped} dropped by Serve, {leaked} leaked by kvserve")


if __name__ == "__main__":
    main()
