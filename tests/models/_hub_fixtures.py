"""Hub repos for the tests, offline: a hub cache laid out by hand as huggingface_hub lays it out
(``models--org--name/{blobs, snapshots/<commit>/..., refs/<name>}``), and a fake hub endpoint on loopback that serves
repos through the same HTTP routes as the hub (repo info, tree listing, ``resolve`` downloads) and counts what it
serves."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

__all__ = ["FakeHub", "HubRepo", "folder_files", "lay_out_snapshot"]


def folder_files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder``: path relative to it (posix) -> its bytes."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def lay_out_snapshot(cache: Path, repo_id: str, files: dict[str, bytes], *, commit: str,
                     refs: tuple[str, ...] = ("main",)) -> Path:
    """Write ``files`` into the hub cache ``cache`` as commit ``commit`` of ``repo_id``: each file a blob named by its
    sha256, linked from ``snapshots/<commit>/`` by a relative symlink, and each of ``refs`` naming the commit (as
    huggingface_hub leaves a download). Returns the snapshot folder."""
    storage = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    for rel, data in files.items():
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (storage / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return snapshot


@dataclass
class HubRepo:
    """One repo the fake hub serves."""

    commits: dict[str, dict[str, bytes]]
    """Commit hash -> its files (path -> bytes)."""
    refs: dict[str, str]
    """Branch or tag -> commit hash."""
    gated: bool = False
    """Its files answer 401 ``GatedRepo`` (its info stays public, as the hub's)."""

    def commit(self, revision: str) -> str | None:
        return revision if revision in self.commits else self.refs.get(revision)


@dataclass
class FakeHub:
    """A hub endpoint on 127.0.0.1 serving ``repos``; ``downloads`` counts each file's GETs as ``(repo, path)``.
    While ``hold`` is clear, file downloads wait for it (``first_download`` is set when the first one arrives), so a
    test can act while a download is under way."""

    repos: dict[str, HubRepo]
    downloads: Counter = field(default_factory=Counter)
    hold: threading.Event = field(default_factory=threading.Event)
    first_download: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

            def do_GET(self) -> None:
                hub._answer(self, body=True)

        self.hold.set()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _answer(self, handler: BaseHTTPRequestHandler, *, body: bool) -> None:
        parts = [unquote(p) for p in urlsplit(handler.path).path.strip("/").split("/")]
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            repo_id, kind, revision, rest = "/".join(parts[2:4]), parts[4], parts[5], "/".join(parts[6:])
            self._api(handler, repo_id, kind, revision, rest)
        elif len(parts) >= 5 and parts[2] == "resolve":
            self._file(handler, "/".join(parts[:2]), parts[3], "/".join(parts[4:]), body=body)
        else:
            self._send(handler, 404, b"{}", {"X-Error-Code": "RepoNotFound"})

    def _lookup(self, handler, repo_id: str, revision: str) -> tuple[HubRepo, str] | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._send(handler, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
            return None
        commit = repo.commit(revision)
        if commit is None:
            self._send(handler, 404, b'{"error": "Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"})
            return None
        return repo, commit

    def _api(self, handler, repo_id: str, kind: str, revision: str, rest: str) -> None:
        found = self._lookup(handler, repo_id, revision)
        if found is None:
            return
        repo, commit = found
        files = repo.commits[commit]
        if kind == "revision":
            data = {"id": repo_id, "sha": commit, "siblings": [{"rfilename": f} for f in sorted(files)],
                    "gated": repo.gated, "private": False}
        else:
            data = [{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                    for f, b in sorted(files.items()) if f.startswith(rest)]
        self._send(handler, 200, json.dumps(data).encode(), {"Content-Type": "application/json"})

    def _file(self, handler, repo_id: str, revision: str, path: str, *, body: bool) -> None:
        found = self._lookup(handler, repo_id, revision)
        if found is None:
            return
        repo, commit = found
        if repo.gated:
            self._send(handler, 401, b'{"error": "gated"}', {"X-Error-Code": "GatedRepo"})
            return
        data = repo.commits[commit].get(path)
        if data is None:
            self._send(handler, 404, b"{}", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit})
            return
        if body:
            self.downloads[(repo_id, path)] += 1
            self.first_download.set()
            self.hold.wait(timeout=120)
        headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                   "Content-Type": "application/octet-stream"}
        self._send(handler, 200, data, headers, body=body)

    @staticmethod
    def _send(handler, status: int, data: bytes, headers: dict[str, str], *, body: bool = True) -> None:
        handler.send_response(status)
        for name, value in headers.items():
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if body and handler.command != "HEAD":
            handler.wfile.write(data)
