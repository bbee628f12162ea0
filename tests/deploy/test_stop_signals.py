"""StopSignals, the signal handling of `kvserve serve`, in a process of its own: a signal
during the start unwinds it; one that comes while the main thread is stuck in C code (as in
a Ray start that hangs) is still acted on, by the watcher thread."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

PRELUDE = textwrap.dedent("""
    import ctypes, os, sys, time
    from kvserve.deploy.serve_stop import StopSignals

    def stuck():
        print("stuck: ended by the watcher", flush=True)
        os._exit(0)

    signals = StopSignals(stuck, stuck_s=1.0)
""")

# the main thread blocks in a futex wait that no signal interrupts (glibc retries it), with
# the GIL released: as in a Ray call waiting in C++
STUCK = PRELUDE + textwrap.dedent("""
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)  # PTHREAD_MUTEX_INITIALIZER: all zero
    libc.pthread_mutex_lock(mutex)
    print("ready", flush=True)
    libc.pthread_mutex_lock(mutex)  # a default mutex locked twice: never returns
    print("not reached", flush=True)
""")

STARTING = PRELUDE + textwrap.dedent("""
    try:
        with signals.interrupting():
            print("ready", flush=True)
            while True:
                time.sleep(0.05)  # a start that Python code runs
    except KeyboardInterrupt:
        print("start unwound", signals.stop.is_set(), signals.signum, flush=True)
    time.sleep(3)  # the watcher must not act: the handler ran
    print("done", flush=True)
""")


def _run(script: str, sig: int, stuck: bool = False) -> tuple[int, str, float]:
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "ready"
    if stuck:  # signal only once the main thread waits in the futex (not while it still
        _wait_in_futex(p.pid)  # runs Python code between "ready" and the lock)
    t0 = time.monotonic()
    p.send_signal(sig)
    try:
        out, _ = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    return p.returncode, out, time.monotonic() - t0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_unwinds_the_start(sig):
    rc, out, _ = _run(STARTING, sig)
    assert rc == 0
    assert out.splitlines() == [f"start unwound True {int(sig)}", "done"]


def _wait_in_futex(pid: int, timeout: float = 60.0) -> None:
    """Until the process's main thread sleeps in a futex wait (its kernel wait channel)."""
    deadline = time.monotonic() + timeout
    while True:
        with open(f"/proc/{pid}/task/{pid}/wchan") as f:
            if "futex" in f.read():
                return
        assert time.monotonic() < deadline, "the main thread never blocked in the lock"
        time.sleep(0.01)


def test_a_signal_reaches_a_main_thread_stuck_in_c():
    rc, out, took = _run(STUCK, signal.SIGTERM, stuck=True)
    assert rc == 0 and out.splitlines() == ["stuck: ended by the watcher"], out
    assert took >= 1.0  # the watcher gave the handler its time first
