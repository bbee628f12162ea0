"""A local stand-in for the Hugging Face Hub's download routes, for tests without network.

It answers what huggingface_hub asks when kvserve fetches a model: the model info with file
metadata (`/api/models/{repo}/revision/{rev}?blobs=true`) and the files themselves
(`HEAD`/`GET /{repo}/resolve/{rev}/{path}`, with ranges), with the Hub's headers (X-Repo-Commit,
ETag / X-Linked-Etag, X-Linked-Size) and error codes (X-Error-Code: RepoNotFound,
RevisionNotFound, EntryNotFound, GatedRepo). A test can hold a file's transfer at a byte
offset until it lets go, or cut the connection there once (huggingface_hub then resumes with a
range request), and read back every request made.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")


@dataclass
class Commit:
    sha: str
    files: dict[str, bytes]


@dataclass
class Repo:
    commits: dict[str, Commit] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> sha
    gated: bool = False


@dataclass
class Hold:
    """Stop a file's GET after `at` bytes until `release` is set (or cut it, once)."""

    at: int
    release: threading.Event = field(default_factory=threading.Event)
    reached: threading.Event = field(default_factory=threading.Event)
    cut: bool = False  # close the connection at `at` instead of waiting (once)


def folder_files(folder: str) -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(folder):
        for n in names:
            path = os.path.join(root, n)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder).replace(os.sep, "/")] = f.read()
    return out


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _is_lfs(name: str) -> bool:
    return name.endswith(LFS_SUFFIXES)


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.holds: dict[str, Hold] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # method, path, Range header
        self.token: str | None = None  # the one a gated repo accepts
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                hub._serve(self, body=True)

            def do_HEAD(self) -> None:
                hub._serve(self, body=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        for h in self.holds.values():
            h.release.set()
        self.server.shutdown()
        self.server.server_close()

    # ---- content ------------------------------------------------------------------------------
    def add_commit(self, repo_id: str, files: dict[str, bytes], refs: tuple[str, ...] = ("main",),
                   gated: bool = False) -> str:
        repo = self.repos.setdefault(repo_id, Repo())
        repo.gated = repo.gated or gated
        digest = hashlib.sha1(repo_id.encode() + json.dumps(sorted(
            (n, hashlib.sha256(d).hexdigest()) for n, d in files.items())).encode())
        sha = digest.hexdigest()
        repo.commits[sha] = Commit(sha, dict(files))
        for r in refs:
            repo.refs[r] = sha
        return sha

    def file_gets(self, name: str) -> list[str | None]:
        """The Range headers of the GETs of files named `name` (None: the whole file)."""
        return [r for m, p, r in self.requests if m == "GET" and p.endswith("/" + name)
                and "/resolve/" in p]

    # ---- serving ------------------------------------------------------------------------------
    def _serve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = urlparse(h.path).path
        self.requests.append((h.command, path, h.headers.get("Range")))
        m = re.match(r"^/api/models/([^/]+/[^/]+)/revision/([^/]+)$", path)
        if m:
            return self._info(h, m[1], unquote(m[2]), body)
        m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if m:
            return self._file(h, m[1], unquote(m[2]), unquote(m[3]), body)
        self._error(h, 404, None, body)

    def _commit(self, h, repo_id: str, rev: str, body: bool) -> Commit | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._error(h, 401, "RepoNotFound", body)  # the Hub's answer to unknown and private
            return None
        if repo.gated and h.headers.get("authorization") != f"Bearer {self.token}":
            self._error(h, 401, "GatedRepo", body)
            return None
        sha = rev if rev in repo.commits else repo.refs.get(rev)
        if sha is None:
            self._error(h, 404, "RevisionNotFound", body)
            return None
        return repo.commits[sha]

    def _info(self, h, repo_id: str, rev: str, body: bool) -> None:
        commit = self._commit(h, repo_id, rev, body)
        if commit is None:
            return
        siblings = []
        for name, data in sorted(commit.files.items()):
            s = {"rfilename": name, "size": len(data), "blobId": _git_blob_id(data)}
            if _is_lfs(name):
                s["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                            "pointerSize": 130}
            siblings.append(s)
        payload = json.dumps({"id": repo_id, "modelId": repo_id, "sha": commit.sha,
                              "private": False, "siblings": siblings}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        if body:
            h.wfile.write(payload)

    def _file(self, h, repo_id: str, rev: str, name: str, body: bool) -> None:
        commit = self._commit(h, repo_id, rev, body)
        if commit is None:
            return
        data = commit.files.get(name)
        if data is None:
            self._error(h, 404, "EntryNotFound", body, commit.sha)
            return
        start, end = 0, len(data) - 1
        rng = h.headers.get("Range")
        if rng:
            m = re.match(r"bytes=(\d+)-(\d*)", rng)
            start = int(m[1])
            end = min(end, int(m[2])) if m[2] else end
        part = data[start:end + 1]
        h.send_response(206 if rng else 200)
        h.send_header("X-Repo-Commit", commit.sha)
        if _is_lfs(name):
            h.send_header("X-Linked-Etag", f'"{hashlib.sha256(data).hexdigest()}"')
            h.send_header("X-Linked-Size", str(len(data)))
            h.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        else:
            h.send_header("ETag", f'"{_git_blob_id(data)}"')
        if rng:
            h.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        h.send_header("Content-Length", str(len(part)))
        h.send_header("Accept-Ranges", "bytes")
        h.end_headers()
        if not body:
            return
        hold = self.holds.get(name)
        if hold is not None and start < hold.at <= end + 1:  # (a range short of it: no wait)
            h.wfile.write(part[: hold.at - start])
            h.wfile.flush()
            hold.reached.set()
            if hold.cut:
                del self.holds[name]  # once: the resumed request gets the rest
                h.close_connection = True
                h.connection.shutdown(2)
                return
            hold.release.wait()
            part = part[hold.at - start:]
        h.wfile.write(part)

    def _error(self, h, status: int, code: str | None, body: bool, sha: str | None = None) -> None:
        payload = json.dumps({"error": code or "not found"}).encode()
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
        if sha:
            h.send_header("X-Repo-Commit", sha)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        if body:
            h.wfile.write(payload)
