"""Bytes of a Hub download so far, read from the cache itself while huggingface_hub fetches.

huggingface_hub writes each file to `blobs/<etag>[.<id>].incomplete` and renames it to
`blobs/<etag>` (linked from `snapshots/<commit>/<name>`) when done, so the sizes on disk are the
real bytes received, whichever transfer (HTTP with its resumes, or Xet) it uses and whatever
progress bars are turned off.
"""

from __future__ import annotations

import glob
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

POLL_S = 0.5
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileToFetch:
    name: str  # path in the repository
    size: int  # bytes (0 when the Hub did not say)
    blob: str | None  # the cache's blob name: the LFS sha256, or the git blob id


@dataclass(frozen=True)
class DownloadProgress:
    model: str
    done_bytes: int
    total_bytes: int
    files_done: int
    files_total: int

    def state(self) -> str:
        """A worker's start-up state while it downloads."""
        pct = 100.0 * self.done_bytes / self.total_bytes if self.total_bytes else 0.0
        return (f"downloading {self.model}: {_size(self.done_bytes)} of "
                f"{_size(self.total_bytes)} ({pct:.0f}%, {self.files_done}/{self.files_total} "
                "files)")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def measure(model: str, snapshot: str, storage: str, files: list[FileToFetch]
            ) -> DownloadProgress:
    done = files_done = 0
    for f in files:
        if os.path.exists(os.path.join(snapshot, f.name)):
            files_done += 1
        done += min(_file_bytes(snapshot, storage, f), f.size or 1 << 62)
    total = sum(f.size for f in files)
    return DownloadProgress(model, min(done, total) if total else done, total, files_done,
                            len(files))


def _file_bytes(snapshot: str, storage: str, f: FileToFetch) -> int:
    """Bytes of `f` on disk. A part file is renamed to its blob atomically, so looking at the
    blob again after the parts catches a rename in between (the count never goes back)."""
    if not f.blob:
        return _getsize(os.path.join(snapshot, f.name)) or 0
    blob = os.path.join(storage, "blobs", f.blob)
    if os.path.exists(blob):
        return _getsize(blob) or 0
    parts = glob.glob(glob.escape(blob) + "*.incomplete")
    sizes = [n for n in map(_getsize, parts) if n is not None]
    if sizes:
        return max(sizes)
    return (_getsize(blob) or 0) if os.path.exists(blob) else 0


def _getsize(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except OSError:  # renamed into place between the look and here
        return None


class ProgressPoller:
    """Calls `report` with the download's progress every POLL_S while it runs, when it moved."""

    def __init__(self, model: str, snapshot: str, storage: str, files: list[FileToFetch],
                 report: Callable[[DownloadProgress], None], period_s: float = POLL_S) -> None:
        self.args = (model, snapshot, storage, files)
        self.report, self.period_s = report, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hub-progress", daemon=True)
        self._last: DownloadProgress | None = None

    def start(self) -> None:
        self._tick()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._tick()  # the final figures

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._tick()

    def _tick(self) -> None:
        p = measure(*self.args)
        if p != self._last:
            self._last = p
            try:
                self.report(p)
            except Exception:  # a report lost is no reason to stop the download
                log.exception("reporting the download's progress failed")
