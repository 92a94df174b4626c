"""A Hugging Face Hub stand-in on loopback: the file API huggingface_hub uses, over one model
repository read from a local directory (a tiny saved checkpoint).

Clients reach it as they reach a mirror: ``HF_ENDPOINT=<server.url>`` (or ``endpoint=``). It
answers what ``HfApi.model_info``, ``list_repo_tree``, ``snapshot_download`` and
``hf_hub_download`` ask (the paths and headers of huggingface_hub's ``hf_api.py`` and
``file_download.py``):

- ``GET /api/models/{repo}[/revision/{rev}]``: ``sha`` (the commit) and ``siblings`` with ``size``,
  ``blobId`` and, for LFS files, ``lfs`` {``sha256``, ``size``, ``pointerSize``};
- ``GET /api/models/{repo}/tree/{rev}``: every file as ``{type, path, size, oid, lfs}``;
- ``HEAD /{repo}/resolve/{rev}/{path}``: ``X-Repo-Commit``, ``ETag`` (the git blob id; for LFS
  files the sha256, also as ``X-Linked-Etag``), ``X-Linked-Size`` for LFS files;
- ``GET /{repo}/resolve/{rev}/{path}``: the bytes, with ``Range: bytes=N-`` answered 206.

``rev`` is ``main`` or the commit. Files named ``*.safetensors`` and ``*.gguf`` are the LFS ones,
as on the Hub.
Faults, for tests: ``corrupt`` serves other bytes (same size) for a path than the metadata
promises; ``cut`` sends only the first half of a path's body on its next full GET and drops the
connection; ``rate`` sends file bodies at that many bytes per second, as a slow link would.
Counters (``requests``, ``body_bytes``) say what clients fetched. ``also_serve`` puts another
``HubServer``'s repository behind the same endpoint (a model and its adapters on one mirror); that
one answers its own paths and keeps its own counters.

Ownership: the server thread owns the sockets; counters and faults are guarded by one lock.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".gguf")


@dataclass(frozen=True)
class HubFile:
    path: str
    data: bytes

    @property
    def lfs(self) -> bool:
        return self.path.endswith(LFS_SUFFIXES)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def blob_id(self) -> str:
        """git's object id of the content (the Hub gives that of the LFS pointer for LFS files,
        whose check is their sha256)."""
        header = f"blob {len(self.data)}\0".encode()
        return hashlib.sha1(header + self.data).hexdigest()


@dataclass
class HubServer:
    """One repository ``repo`` at one commit, served from ``source`` (every file under it)."""

    repo: str
    source: Path
    files: dict[str, HubFile] = field(default_factory=dict)
    commit: str = ""
    requests: Counter[str] = field(default_factory=Counter)  # "GET /path" -> count
    body_bytes: Counter[str] = field(default_factory=Counter)  # file path -> bytes sent
    ranges: list[tuple[str, int]] = field(default_factory=list)  # (file path, first byte)
    corrupt: dict[str, bytes] = field(default_factory=dict)
    cut: set[str] = field(default_factory=set)
    rate: float | None = None  # bytes per second of each file body (a slow link); None: no limit
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None
    _others: dict[str, HubServer] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for path in sorted(p for p in self.source.rglob("*") if p.is_file()):
            rel = path.relative_to(self.source).as_posix()
            self.files[rel] = HubFile(rel, path.read_bytes())
        listing = "".join(f"{f.path}:{f.sha256}\n" for f in self.files.values())
        self.commit = hashlib.sha1(listing.encode()).hexdigest()

    @property
    def url(self) -> str:
        assert self._server is not None, "start() first"
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def total_bytes(self) -> int:
        return sum(len(f.data) for f in self.files.values())

    def file_requests(self) -> int:
        """GETs of file bodies so far."""
        with self._lock:
            return sum(n for key, n in self.requests.items() if key.startswith("GET /") and
                       "/resolve/" in key)  # fmt: skip

    def sent(self) -> int:
        """File body bytes sent so far."""
        with self._lock:
            return sum(self.body_bytes.values())

    def also_serve(self, other: HubServer) -> HubServer:
        """Answer ``other.repo``'s paths from ``other`` (not started itself); returns ``other``."""
        self._others[other.repo] = other
        return other

    def start(self, host: str = "127.0.0.1") -> HubServer:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub._handle(self, head=False)

            def do_HEAD(self) -> None:
                hub._handle(self, head=True)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    # -- answers -----------------------------------------------------------------------------

    def _handle(self, req: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlsplit(req.path).path)
        for repo, other in self._others.items():
            if path.startswith((f"/api/models/{repo}/", f"/{repo}/resolve/")) or path == (
                f"/api/models/{repo}"
            ):
                other._handle(req, head)
                return
        with self._lock:
            self.requests[f"{req.command} {path}"] += 1
        api = f"/api/models/{self.repo}/"
        resolve = f"/{self.repo}/resolve/"
        if path == api.rstrip("/") and not head:  # no revision: the default branch
            self._json(req, self._model_info())
        elif path.startswith(api + "revision/") and not head:
            revision = path[len(api + "revision/") :]
            self._json(req, self._model_info() if self._known(revision) else None)
        elif path.startswith(api + "tree/") and not head:
            revision = path[len(api + "tree/") :].split("/", 1)[0]
            self._json(req, self._tree() if self._known(revision) else None)
        elif path.startswith(resolve):
            revision, _, name = path[len(resolve) :].partition("/")
            hub_file = self.files.get(name) if self._known(revision) else None
            if hub_file is None:
                self._error(req, 404, "EntryNotFound")
            else:
                self._file(req, hub_file, head)
        else:
            self._error(req, 404, "RepoNotFound")

    def _known(self, revision: str) -> bool:
        return revision in ("main", self.commit)

    def _model_info(self) -> dict[str, Any]:
        siblings = []
        for f in self.files.values():
            sibling: dict[str, Any] = {
                "rfilename": f.path,
                "size": len(f.data),
                "blobId": f.blob_id,
            }
            if f.lfs:
                sibling["lfs"] = {"sha256": f.sha256, "size": len(f.data), "pointerSize": 134}
            siblings.append(sibling)
        return {"id": self.repo, "modelId": self.repo, "sha": self.commit, "siblings": siblings}

    def _tree(self) -> list[dict[str, Any]]:
        entries = []
        for f in self.files.values():
            entry: dict[str, Any] = {
                "type": "file", "path": f.path, "size": len(f.data), "oid": f.blob_id,
            }  # fmt: skip
            if f.lfs:
                entry["lfs"] = {"oid": f.sha256, "size": len(f.data), "pointerSize": 134}
            entries.append(entry)
        return entries

    def _json(self, req: BaseHTTPRequestHandler, body: Any) -> None:
        if body is None:
            self._error(req, 404, "RevisionNotFound")
            return
        data = json.dumps(body).encode()
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.send_header("X-Repo-Commit", self.commit)
        req.end_headers()
        req.wfile.write(data)

    def _error(self, req: BaseHTTPRequestHandler, status: int, code: str) -> None:
        data = json.dumps({"error": code}).encode()
        req.send_response(status)
        req.send_header("X-Error-Code", code)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(data)

    def _file(self, req: BaseHTTPRequestHandler, hub_file: HubFile, head: bool) -> None:
        with self._lock:
            data = self.corrupt.get(hub_file.path, hub_file.data)
        etag = hub_file.sha256 if hub_file.lfs else hub_file.blob_id
        start = 0
        wanted = req.headers.get("Range", "")
        if wanted.startswith("bytes=") and wanted.endswith("-") and not head:
            start = int(wanted[len("bytes=") : -1])
        body = data[start:]
        req.send_response(206 if start else 200)
        req.send_header("X-Repo-Commit", self.commit)
        req.send_header("ETag", f'"{etag}"')
        req.send_header("Accept-Ranges", "bytes")
        req.send_header("Content-Length", str(len(body)))
        if hub_file.lfs:
            req.send_header("X-Linked-Etag", f'"{etag}"')
            req.send_header("X-Linked-Size", str(len(hub_file.data)))
        if start:
            req.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        req.end_headers()
        if head:
            return
        with self._lock:
            cut = not start and hub_file.path in self.cut
            self.cut.discard(hub_file.path)
            if start:
                self.ranges.append((hub_file.path, start))
        if cut:
            body = body[: len(body) // 2]
        step = max(1, int(self.rate / 10)) if self.rate else len(body) or 1
        for start_at in range(0, len(body), step):
            req.wfile.write(body[start_at : start_at + step])
            if self.rate:
                time.sleep(step / self.rate)
        req.wfile.flush()
        with self._lock:
            self.body_bytes[hub_file.path] += len(body)
        if cut:
            req.close_connection = True
            req.connection.shutdown(2)
