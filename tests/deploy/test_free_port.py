"""free_port: the ports `kvserve serve` (its dashboard), the serve benches and the tests pick
for a service they start lie outside the kernel's ephemeral range, where Ray's processes take
ports while the service starts; none is in use or handed out twice."""

from __future__ import annotations

import socket

from kvserve.deploy import serve_stop
from kvserve.deploy.serve_stop import free_port, port_in_use


def test_ports_lie_outside_the_ephemeral_range_and_are_free() -> None:
    lo, hi = serve_stop._ephemeral_ports()
    ports = [free_port() for _ in range(40)]
    assert len(set(ports)) == len(ports)
    for p in ports:
        assert not lo <= p <= hi and p >= 20000, (p, lo, hi)
        assert not port_in_use(p)


def test_a_held_port_is_never_handed_out(monkeypatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("0.0.0.0", 0))  # (not through free_port: it would not hand it out again)
        held.listen()
        port = held.getsockname()[1]
        # every choice but the held port lies inside the ephemeral range
        monkeypatch.setattr(serve_stop, "_PORTS_FROM", port)
        monkeypatch.setattr(serve_stop, "_ephemeral_ports", lambda: (port + 1, 65535))
        got = free_port()
        assert got != port and not port_in_use(got)  # (an ephemeral port, the fallback)


def test_an_ephemeral_range_that_leaves_nothing_falls_back(monkeypatch) -> None:
    monkeypatch.setattr(serve_stop, "_ephemeral_ports", lambda: (1024, 65535))
    p = free_port()
    assert 1024 <= p <= 65535 and not port_in_use(p)
