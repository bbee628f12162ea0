"""How `kvserve serve` stops: on SIGTERM or SIGINT, whenever it comes, with status 0 and its
ports free.

Its handlers are installed before anything starts, and kept while Ray starts: `ray.init`
sets SIGTERM handlers of its own, which would exit at once (status 15) or drain the node
for up to 30 s and exit with status 1. A signal during start-up unwinds the start (as
Ctrl-C does); one after it starts the stop, in which requests in flight get the app's
`shutdown_grace_s` (deploy/shutdown.py). A second signal cuts the grace period short.

SIGTERM to the whole process group (systemd's `KillMode=control-group`) reaches the Ray
processes this command started too: Ray's dashboard and monitors end at once, its actors
start exiting and Serve stops answering. The stop notices one of them end and does not wait
on them (nor on a GCS that may be gone: a driver waits 60 s for one). Ctrl-C in a terminal
reaches only this command: Ray's processes block SIGINT. Either way the Ray processes this
command started are ended, and the HTTP and gRPC ports are free before it returns.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# the app gets shutdown_grace_s and this much more to go (its replica notices the stop on its
# next poll of Serve's state; its aborted requests' answers reach their clients)
APP_MARGIN_S = 3.0
RAY_SHUTDOWN_S = 3.0  # disconnecting from a joined Ray
# the whole stop is over this long after the grace period (the processes ended, their ports
# closed: on a loaded machine a killed process can take seconds to go)
STOP_WITHIN_S = 9.0
PR_SET_CHILD_SUBREAPER = 36
STUCK_S = 5.0  # a signal's Python handler has not run this long after it: the main thread is stuck


class StopSignals:
    """SIGTERM / SIGINT handling of `kvserve serve`: the first signal asks for a stop (and
    unwinds a start in progress), a second one forces it.

    Python runs a signal's handler in the main thread once it is back in Python code; a
    start stuck inside Ray's C++ (a raylet that never answers) would never get there. The
    signal also wakes a watcher thread (Python's wakeup fd); when the handler has not run
    `stuck_s` later, the watcher calls `on_stuck` (end what started, exit)."""

    def __init__(self, on_stuck: Callable[[], None] | None = None, stuck_s: float = STUCK_S
                 ) -> None:
        self.stop = threading.Event()
        self.force = threading.Event()
        self.signum: int | None = None
        self.at: float | None = None  # when the first signal came (monotonic)
        self._interrupt = False
        self.on_stuck, self.stuck_s = on_stuck, stuck_s
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self.install()
        threading.Thread(target=self._watch, name="stop-signal-watch", daemon=True).start()

    def install(self) -> None:
        for s in SIGNALS:
            signal.signal(s, self._handle)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)

    def _watch(self) -> None:
        while os.read(self._wake_r, 1)[0] not in SIGNALS:
            pass
        deadline = time.monotonic() + self.stuck_s
        while not self.stop.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not self.stop.is_set() and self.on_stuck is not None:
            log.warning("kvserve: the start is stuck in Ray and cannot take the signal; "
                        "ending what started")
            self.on_stuck()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.stop.is_set():
            self.force.set()
            return
        self.signum, self.at = signum, time.monotonic()
        self.stop.set()
        if self._interrupt:
            self._interrupt = False
            # KeyboardInterrupt: what Ray's blocking calls (ray.get in serve.run) pass on
            raise KeyboardInterrupt(signal.Signals(signum).name)

    @contextlib.contextmanager
    def interrupting(self) -> Iterator[None]:
        """A signal inside the block unwinds it with KeyboardInterrupt (the start-up)."""
        self._interrupt = not self.stop.is_set()
        try:
            if self.stop.is_set():
                raise KeyboardInterrupt("stopped before the start")
            yield
        finally:
            self._interrupt = False

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        """Keep these handlers through a call that would replace them (`ray.init`: Ray's
        SIGTERM handlers; its core worker's C-level failure-signal handler, replaced on
        the way out)."""
        real = signal.signal

        def guarded(signum: int, handler: Any) -> Any:
            if signum == signal.SIGTERM and threading.current_thread() is threading.main_thread():
                return signal.getsignal(signum)
            return real(signum, handler)

        signal.signal = guarded
        try:
            yield
        finally:
            signal.signal = real
            self.install()


def become_subreaper() -> bool:
    """Make processes orphaned below this one (a Ray worker whose raylet died first) its
    children rather than init's, so the stop can still find and end them (Linux)."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def port_in_use(port: int) -> bool:
    """Whether a server holds `port` (a new one could not bind it, on any address family)."""
    for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 here
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return True
    return False


# free_port's choices lie outside the kernel's ephemeral range, where the kernel picks the
# ports of outgoing connections and of servers that bind port 0 (Ray's processes, while a
# service starts): a port seen free there can be taken before the service binds it. They
# also stay above Ray's default worker ports (10002-19999).
_PORTS_FROM = 20000
_handed_out: set[int] = set()


def _ephemeral_ports() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A port no server holds, outside the ephemeral range (and not handed out before by
    this process); an ephemeral one where that range leaves none."""
    import random

    lo, hi = _ephemeral_ports()
    spans = [r for r in (range(_PORTS_FROM, lo), range(max(hi + 1, _PORTS_FROM), 65536)) if r]
    for _ in range(200 if spans else 0):
        port = random.choice(random.choices(spans, weights=[len(r) for r in spans])[0])
        if port not in _handed_out and not port_in_use(port):
            _handed_out.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OwnRay:
    """The Ray processes this command started (none when it joined a running Ray)."""

    def __init__(self) -> None:
        import psutil

        # GCS, raylet, dashboard, log monitor...: none of them ends while Ray runs (those
        # running now: one that ended before does not count)
        self.core: list[Any] = []
        node = _own_node()
        if node is not None:
            for infos in node.all_processes.values():
                for info in infos:
                    with contextlib.suppress(psutil.Error):
                        p = psutil.Process(info.process.pid)
                        if p.status() != psutil.STATUS_ZOMBIE:
                            self.core.append(p)

    def gone(self) -> bool:
        """Whether one of them ended: the signal reached them too (a signal to the process
        group; Ray's dashboard and monitors end at once, its actors and GCS begin exiting
        and stop answering)."""
        import psutil

        for p in self.core:
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    return True
            except psutil.Error:
                return True
        return False


def _own_node() -> Any:
    """Ray's node object when this process started the node (a head node of its own)."""
    try:
        from ray._private import worker
    except ImportError:
        return None
    node = getattr(worker, "_global_node", None)
    if node is None or not getattr(node, "head", False) or not node.all_processes:
        return None
    return node


def descendants() -> list[Any]:
    import psutil

    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def stop_service(graceful: Callable[[], None], grace_s: float, signals: StopSignals,
                 ports: list[int]) -> None:
    """Stop: `graceful` (delete the app: requests in flight get their grace period) while the
    serving processes are there to finish them, then end the Ray this command started (or
    the part of it that had started; a joined Ray is only disconnected from), and wait
    until `ports` are free."""
    import ray

    start = signals.at or time.monotonic()
    if ray.is_initialized():
        own = OwnRay()
        # Serve's proxies hold the ports: once they are free, nothing serves the requests
        # in flight any more (the proxies went with a signal to the process group)
        serving = (lambda: any(port_in_use(p) for p in ports)) if own.core else (lambda: True)
        _bounded(graceful, start + grace_s + APP_MARGIN_S, own, serving, signals)
    if not _running(descendants()) and ray.is_initialized():
        # joined: its processes are not this command's to stop; disconnect
        t = threading.Thread(target=_quietly(ray.shutdown), name="ray-shutdown", daemon=True)
        t.start()
        t.join(RAY_SHUTDOWN_S)
    end_own_processes(ports, max(start + grace_s + STOP_WITHIN_S, time.monotonic() + 3.0))


def end_own_processes(ports: list[int], deadline: float) -> None:
    """End the Ray this command started (or the part of it that had started), and wait until
    `ports` are free (both until `deadline`). Ray's own shutdown would stop its processes one
    by one, each given its time, and talk to a GCS that may be gone; the app is stopped, so
    they go together. Again while any is left: a raylet still running may have started a
    worker meanwhile (an actor restarted)."""
    while True:
        left = _running(descendants())
        busy = [p for p in ports if p and port_in_use(p)]
        if not (left or busy) or time.monotonic() > deadline:
            break
        _end(left)
        if not left:  # the ports' sockets close a moment after their processes end
            time.sleep(0.1)
    if left or busy:
        log.warning("kvserve: still running: %d processes; ports in use: %s", len(left), busy)


def _bounded(graceful: Callable[[], None], deadline: float, own: OwnRay,
             serving: Callable[[], bool], signals: StopSignals) -> None:
    """Run `graceful` until it returns, the deadline passes, a second signal comes, or the
    processes it needs are gone (those of the Ray this command started)."""
    t = threading.Thread(target=_quietly(graceful), name="graceful-stop", daemon=True)
    t.start()
    while t.is_alive():
        if own.gone() or not serving():
            log.warning("kvserve: Ray's processes went with the same signal; not waiting for "
                        "them")
            return
        if signals.force.is_set():
            log.warning("kvserve: second signal: stopping now")
            return
        if time.monotonic() > deadline:
            log.warning("kvserve: the app did not stop within its grace period; stopping Ray")
            return
        t.join(0.1)


def _quietly(fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        try:
            fn()
        except Exception as e:  # Serve or Ray already gone: the hard stop follows
            log.warning("kvserve: %s during the stop: %s", getattr(fn, "__name__", fn), e)
    return run


def _running(procs: list[Any]) -> list[Any]:
    import psutil

    out = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def _end(procs: list[Any], wait_s: float = 1.0) -> None:
    """SIGTERM, then SIGKILL for those still running after `wait_s`."""
    import psutil

    for sig in (signal.SIGTERM, signal.SIGKILL):
        left = _running(procs)
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)
        deadline = time.monotonic() + wait_s
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = _running(left)
        if not left:
            return
