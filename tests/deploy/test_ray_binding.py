"""A Ray that kvserve starts itself listens on the loopback interface only.

Known exceptions, both Ray Serve's and not configurable in this Ray version: the gRPC proxy
(kvserve's gRPC API port) and each Serve replica's inter-deployment gRPC server bind to
every interface ([::]); docs/serving.md (Security) says so.
"""

from __future__ import annotations

import os

import psutil

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def _listening() -> list[tuple[str, int, str, int]]:
    """(title, pid, address, port) of every listening TCP socket of this process's Ray."""
    me = psutil.Process(os.getpid())
    out = []
    for p in [me, *me.children(recursive=True)]:
        try:
            title = os.path.basename((p.cmdline() or [p.name()])[0])
            conns = p.net_connections(kind="inet")
        except psutil.Error:  # exited meanwhile
            continue
        out += [(title, p.pid, c.laddr.ip, c.laddr.port) for c in conns
                if c.status == psutil.CONN_LISTEN]
    return out


def test_ray_started_by_kvserve_listens_on_loopback_only(serve_app):
    socks = _listening()
    titles = {t for t, *_ in socks}
    # the cluster's own servers are among them: GCS, raylet, workers, the Serve actors
    for part in ("gcs_server", "raylet", "ray::RouterActor", "ray::WorkerActor", "ray::ProxyActor"):
        assert any(t.startswith(part) for t in titles), (part, titles)
    exposed = [s for s in socks if s[2] not in LOOPBACK]
    serve_grpc = [s for s in exposed if s[3] == serve_app.grpc_port
                  and s[0].startswith("ray::ProxyActor")]
    replica_internal = [s for s in exposed if s[0].startswith("ray::ServeReplica")]
    assert serve_grpc, exposed  # Ray Serve binds its gRPC proxy to [::] (see the docstring)
    assert sorted(exposed) == sorted(serve_grpc + replica_internal), exposed
    assert len(replica_internal) <= 1, replica_internal  # one ingress replica, one server


def test_local_ray_init_binds_to_the_given_host():
    from kvserve.deploy.serve_cli import local_ray_init

    assert local_ray_init() == {"_node_ip_address": "127.0.0.1", "dashboard_host": "127.0.0.1"}
    assert local_ray_init("10.0.0.5")["_node_ip_address"] == "10.0.0.5"
