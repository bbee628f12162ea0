"""A real `kvserve serve` command in its own process group, on free ports: its output as it
comes, its ports, its endpoints as the banner names them, and how it ended."""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
from serve_fixtures import free_port

from kvserve.deploy.serve_stop import port_in_use

# small and frugal: one torch thread, a small KV pool, a short context
ENGINE_ARGS = ["--threads", "1", "--kv-cache-tokens", "4096", "--max-model-len", "1024",
               "--max-num-seqs", "4"]
# Ray's start and Serve's proxies can take minutes on a loaded 2-core machine
START_S = 600.0


class ServeProcess:
    def __init__(self, *extra: str, workers: int = 1, grace_s: float = 6.0,
                 env: dict[str, str] | None = None) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        self.metrics_port, self.dashboard_port = free_port(), free_port()
        self.grace_s = grace_s
        kvserve = str(Path(sys.executable).with_name("kvserve"))
        self.argv = [kvserve, "serve", "--workers", str(workers), "--grpc-port",
                     str(self.grpc_port), "--http-port", str(self.http_port),
                     "--metrics-port", str(self.metrics_port), "--dashboard-port",
                     str(self.dashboard_port), "--shutdown-grace-s", f"{grace_s:g}",
                     *ENGINE_ARGS, *extra]
        # a Ray of its own even if another one runs on this machine (`ray start`)
        full_env = {**os.environ, "RAY_ADDRESS": "local", "HF_HUB_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        self.lines: list[str] = []
        self.times: list[float] = []  # when each line came, seconds since the start
        self._new_line = threading.Condition()
        self.signalled_at: float | None = None
        self.ended_at: float | None = None
        # its own session and process group: a signal to the group reaches it and its Ray
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=full_env, start_new_session=True)
        self.pgid = self.proc.pid
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._new_line:
                self.lines.append(line.rstrip("\n"))
                self.times.append(time.monotonic() - self.t0)
                self._new_line.notify_all()
        with self._new_line:
            self._new_line.notify_all()

    @property
    def output(self) -> str:
        """Its output so far, each line with the seconds since the start, and the signal."""
        out = [f"[{t:7.1f}] {ln}" for t, ln in zip(self.times, self.lines, strict=False)]
        if self.signalled_at is not None:
            out.append(f"(signalled at {self.signalled_at - self.t0:.1f} s)")
        return "\n".join(out)

    def wait_for_line(self, pattern: str, timeout: float = START_S) -> re.Match:
        """The first output line matching `pattern` (waits for it)."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._new_line:
            while True:
                for line in self.lines[seen:]:
                    if m := rx.search(line):
                        return m
                seen = len(self.lines)
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise AssertionError(f"kvserve serve exited ({self.proc.returncode}) before "
                                         f"printing {pattern!r}:\n{self.output[-6000:]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {pattern!r} in {timeout:.0f} s:\n"
                                         f"{self.output[-6000:]}")
                self._new_line.wait(min(left, 1.0))

    def wait_ready(self) -> dict[str, str]:
        """Wait for the banner; returns its endpoints (grpc, http, metrics, dashboard)."""
        self.wait_for_line(r"^Ctrl-C to stop")
        found = {}
        for key in ("gRPC", "HTTP", "metrics", "dashboard"):
            m = self.wait_for_line(rf"^  {key}\s+(\S+)", timeout=1)
            found[key.lower()] = m.group(1)
        return found

    def signal(self, sig: int = signal.SIGTERM, group: bool = False) -> None:
        self.signalled_at = time.monotonic()
        if group:
            os.killpg(self.pgid, sig)
        else:
            self.proc.send_signal(sig)

    def wait_exit(self, timeout: float) -> int:
        """Its exit status, waited for up to `timeout` seconds after the signal."""
        assert self.signalled_at is not None
        left = self.signalled_at + timeout - time.monotonic()
        try:
            rc = self.proc.wait(max(left, 0.1))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"kvserve serve still runs {timeout:.0f} s after the signal:\n"
                                 f"{self.output[-6000:]}") from None
        self.ended_at = time.monotonic()
        self._reader.join(10)
        return rc

    def ports(self) -> dict[str, int]:
        return {"gRPC": self.grpc_port, "HTTP": self.http_port, "metrics": self.metrics_port,
                "dashboard": self.dashboard_port}

    def busy_ports(self) -> dict[str, int]:
        return {k: p for k, p in self.ports().items() if port_in_use(p)}

    def left_running(self) -> list[str]:
        """Processes of its session still running (zombies aside)."""
        out = []
        for p in psutil.process_iter(["pid", "name", "status"]):
            try:
                if os.getsid(p.pid) == self.pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    out.append(f"{p.pid} {p.info['name']}")
            except (OSError, psutil.Error):
                continue
        return out

    def kill(self) -> None:
        """Make sure nothing of it is left (test clean-up)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.pgid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            time.sleep(0.5)


@functools.lru_cache(maxsize=1)
def ray_token() -> str:
    """The token of Ray's token authentication, as `ray get-auth-token` prints it."""
    ray_cli = str(Path(sys.executable).with_name("ray"))
    r = subprocess.run([ray_cli, "get-auth-token"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    token = r.stdout.strip().splitlines()[-1].strip()
    assert token
    return token


def actors(dashboard_url: str) -> list[dict[str, Any]]:
    """Every actor, as the dashboard's state API lists it."""
    url = dashboard_url + "/api/v0/actors?detail=true&limit=1000"
    return http_json(url, {"Authorization": f"Bearer {ray_token()}"})["data"]["result"]["result"]


def http_json(url: str, headers: dict[str, str] | None = None, timeout: float = 30) -> Any:
    import json

    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def http_text(url: str, timeout: float = 30) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()
