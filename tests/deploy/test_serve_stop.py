"""`kvserve serve` stops cleanly however it is stopped: a real command, on free ports, stopped
while Ray starts, while its app cannot finish deploying, the moment its endpoints answer,
and with a request streaming. Each time it exits with status 0 within `shutdown_grace_s` +
10 s, its HTTP and gRPC ports are free when it returns, and none of its processes is left.
(A signal to its whole process group: tests/deploy/test_ray_dashboard.py, which ends its
server that way.)"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from serve_process import ServeProcess, http_json

from kvserve.protos import kvserve_pb2 as pb
from kvserve.protos import kvserve_pb2_grpc

pytestmark = pytest.mark.slow  # the heavy tier (README: the two commands)

STOP_MARGIN_S = 10.0  # the command returns within shutdown_grace_s + this


def _stopped_cleanly(sp: ServeProcess, ray_started: bool = True) -> None:
    rc = sp.wait_exit(sp.grace_s + STOP_MARGIN_S)
    out = sp.output
    print(out)  # its timeline, shown with a failure
    assert rc == 0, f"exit status {rc}:\n{out[-6000:]}"
    if ray_started:  # (while ray.init runs, its core worker's C handler prints it first)
        assert "SIGTERM received" not in out, out[-6000:]  # Ray's handler never ran
    busy = {k: p for k, p in sp.busy_ports().items() if k in ("gRPC", "HTTP")}
    assert not busy, f"ports still in use after it returned: {busy}\n{out[-3000:]}"
    assert not sp.left_running(), sp.left_running()


@pytest.fixture
def serve_process():
    started: list[ServeProcess] = []

    def start(*args, **kw) -> ServeProcess:
        sp = ServeProcess(*args, **kw)
        started.append(sp)
        return sp

    yield start
    for sp in started:
        sp.kill()


def test_stopped_while_ray_starts(serve_process):
    sp = serve_process()
    sp.wait_for_line(r"^kvserve: starting")  # handlers in place; Ray's start comes next
    sp.signal(signal.SIGTERM)
    _stopped_cleanly(sp, ray_started=False)


def test_stopped_while_its_app_cannot_finish_deploying(serve_process, smol_path, tmp_path):
    """A worker whose model download is held mid-file (a local stand-in for the Hub) never
    finishes loading: the start-up waits for it (as for a model that takes long to fetch)
    until it is stopped."""
    from hub_server import FakeHub, Hold

    with open(smol_path, "rb") as f:
        data = f.read()
    with FakeHub() as hub:
        hub.add_commit("org/smol-GGUF", {"smol.Q4_1.gguf": data})
        hub.holds["smol.Q4_1.gguf"] = Hold(at=len(data) // 2)  # past the header's bytes
        sp = serve_process("--model", "org/smol-GGUF:smol.Q4_1.gguf", env={
            "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0"})
        sp.wait_for_line(r"^kvserve: worker-0: downloading org/smol-GGUF")
        sp.signal(signal.SIGINT)  # Ctrl-C
        _stopped_cleanly(sp)
    assert "serving" not in sp.output


def test_stopped_the_moment_its_endpoints_answer(serve_process):
    sp = serve_process()
    url = f"http://127.0.0.1:{sp.http_port}/v1/models"
    deadline = time.monotonic() + 600
    while True:
        assert sp.proc.poll() is None, sp.output[-6000:]
        try:
            if http_json(url, timeout=5)["data"]:
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, sp.output[-6000:]
        time.sleep(0.1)
    sp.signal(signal.SIGTERM)
    _stopped_cleanly(sp)


def test_a_stream_in_flight_gets_its_grace_period(serve_process):
    """A request streaming when SIGTERM comes keeps streaming (the workers and proxies are
    still there) for the grace period, then ends with UNAVAILABLE, not a cut connection."""
    sp = serve_process(grace_s=6.0)
    sp.wait_ready()
    chunks: list[float] = []  # when each chunk came
    ended: dict[str, object] = {}

    def stream() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{sp.grpc_port}") as ch:
            stub = kvserve_pb2_grpc.KVServeStub(ch)
            req = pb.GenerateRequest(prompt="Once upon a time", sampling=pb.SamplingParams(
                temperature=0, max_tokens=1000, ignore_eos=True))
            try:
                for c in stub.GenerateStream(req, timeout=600):
                    chunks.append(time.monotonic())
                    if c.finish_reason:
                        ended["finish"] = c.finish_reason
            except grpc.RpcError as e:
                ended["code"], ended["details"] = e.code(), e.details()
            ended["at"] = time.monotonic()

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 300
    while len(chunks) < 2:  # streaming
        assert t.is_alive() and time.monotonic() < deadline, (ended, sp.output[-3000:])
        time.sleep(0.05)
    assert "at" not in ended  # still in flight (1000 tokens take far longer than this)
    sp.signal(signal.SIGTERM)
    _stopped_cleanly(sp)
    t.join(30)
    assert "at" in ended, "the stream did not end with the command"
    after = [c for c in chunks if c > sp.signalled_at]
    assert after, "no chunk came after the signal: the stream was cut at once"
    if "finish" not in ended:  # it did not finish within the grace period: a clear end
        assert ended.get("code") == grpc.StatusCode.UNAVAILABLE, ended
        assert "grace period" in str(ended["details"]), ended
        assert ended["at"] >= sp.signalled_at + sp.grace_s, (ended["at"] - sp.signalled_at)


def test_bad_metrics_port_is_a_clear_error(serve_process):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        sp = serve_process("--metrics-port", str(port))
        sp.signalled_at = time.monotonic()
        rc = sp.wait_exit(120)
    assert rc != 0 and f"port {port} (--metrics-port) is in use" in sp.output, sp.output[-3000:]

