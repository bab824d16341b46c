"""A Hugging Face Hub on 127.0.0.1, for tests of models named by their Hub id (swarm/hub.py): it serves model
folders as repositories through the routes huggingface_hub calls, and records every request it answers.

    GET  /api/models/ORG/NAME/revision/REV      model_info: the commit and its files, with sizes (?blobs=true)
    HEAD /ORG/NAME/resolve/REV/FILE             a file's metadata: X-Repo-Commit, ETag, Content-Length
    GET  /ORG/NAME/resolve/REV/FILE             the file, or the part a Range header asks (206)

It answers as the Hub does: an unknown repository 401 (X-Error-Code: RepoNotFound), a missing revision 404
(RevisionNotFound), a missing file 404 (EntryNotFound), a gated repository's files 401 (GatedRepo) unless the
Authorization header carries its token. `cut_next(FILE)` makes the next GET of that file stop halfway through the
body it announced, as a dropped connection would.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

TOKEN = "hf_local_hub_test_token"
API_ROUTE = re.compile(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?")
FILE_ROUTE = re.compile(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)")


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str
    gated: bool = False

    def info(self, repo_id: str) -> dict:
        return {"id": repo_id, "modelId": repo_id, "sha": self.commit, "private": False,
                "gated": "manual" if self.gated else False,
                "siblings": [{"rfilename": name, "size": len(data)} for name, data in sorted(self.files.items())]}


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    status: int
    body_bytes: int  # what was sent of the body (a cut GET: half of what it announced)
    agent: str  # the User-Agent: a process started with `environment(..., origin=NAME)` says "origin/NAME" there


@dataclass
class LocalHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    _cut: set[str] = field(default_factory=set)
    _connections: list = field(default_factory=list)  # kept alive by clients: closed too when the Hub stops

    def add(self, repo_id: str, folder: Path, gated: bool = False) -> str:
        """Serve the files of `folder` as repo_id's main revision; returns its commit id."""
        files = {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.is_file()}
        commit = hashlib.sha1(repo_id.encode() + b"".join(files.values())).hexdigest()
        self.repos[repo_id] = Repo(files, commit, gated)
        return commit

    def cut_next(self, filename: str) -> None:
        self._cut.add(filename)

    def start(self) -> "LocalHub":
        hub = self

        class Handler(_Handler):
            served = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        """Nothing answers after this, not even on a connection a client keeps alive."""
        self._server.shutdown()
        self._server.server_close()
        for connection in self._connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:  # closed already
                pass

    def file_gets(self, repo_id: str, origin: str | None = None) -> dict[str, int]:
        """The bytes of each of repo_id's files its GETs sent (successful or cut), by file name; `origin`: to the
        process started with that origin only."""
        sent: dict[str, int] = {}
        for request in self.requests:
            match = FILE_ROUTE.fullmatch(request.path)
            if origin is not None and f"origin/{origin}" not in request.agent:
                continue
            if request.method == "GET" and match and match.group(1) == repo_id and request.status in (200, 206):
                sent[match.group(3)] = sent.get(match.group(3), 0) + request.body_bytes
        return sent

    def clear(self) -> None:
        self.requests.clear()


class _Handler(BaseHTTPRequestHandler):
    served: LocalHub
    protocol_version = "HTTP/1.1"  # keep-alive, as the Hub: every reply states its length

    def log_message(self, *args) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        self.served._connections.append(self.connection)

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    def _answer(self, head: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        api, file = API_ROUTE.fullmatch(path), FILE_ROUTE.fullmatch(path)
        if api:
            self._api(path, *api.groups())
        elif file:
            self._file(path, head, *file.groups())
        else:
            self._error(path, 404, "NotFound")

    def _repo(self, path: str, repo_id: str, revision: str | None) -> Repo | None:
        repo = self.served.repos.get(repo_id)
        if repo is None:
            self._error(path, 401, "RepoNotFound", "Repository not found")
        elif revision not in (None, "main", repo.commit):
            self._error(path, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
        else:
            return repo
        return None

    def _api(self, path: str, repo_id: str, revision: str | None) -> None:
        repo = self._repo(path, repo_id, revision)
        if repo is not None:
            self._send(path, 200, json.dumps(repo.info(repo_id)).encode(), {"Content-Type": "application/json"})

    def _file(self, path: str, head: bool, repo_id: str, revision: str, filename: str) -> None:
        repo = self._repo(path, repo_id, revision)
        if repo is None:
            return
        if repo.gated and self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._error(path, 401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access to it "
                                                "and be authenticated to access it. Please log in.")
            return
        data = repo.files.get(filename)
        if data is None:
            self._error(path, 404, "EntryNotFound", f"{filename} does not exist", {"X-Repo-Commit": repo.commit})
            return
        headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                   "Accept-Ranges": "bytes"}
        if head:
            self._send(path, 200, data, headers, head=True)
            return
        start = _range_start(self.headers.get("Range"))
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        cut = filename in self.served._cut
        self.served._cut.discard(filename)
        self._send(path, 206 if start else 200, data[start:], headers, cut=cut)

    def _error(self, path: str, status: int, code: str, message: str = "", headers: dict | None = None) -> None:
        self._send(path, status, json.dumps({"error": message}).encode(),
                   {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json",
                    **(headers or {})})

    def _send(self, path: str, status: int, body: bytes, headers: dict, head: bool = False, cut: bool = False) -> None:
        """The reply; `cut`: the whole body announced, half of it sent, and the connection dropped."""
        head = head or self.command == "HEAD"  # an error's body too: a HEAD reply has none
        sent = 0 if head else len(body) // 2 if cut else len(body)
        self.served.requests.append(Request(self.command, path, self.headers.get("Range"), status, sent,
                                            self.headers.get("User-Agent", "")))
        self.send_response(status)
        for name, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(name, value)
        self.end_headers()
        if not head:
            self.wfile.write(body[:sent])
        if cut:
            self.wfile.flush()
            self.close_connection = True


def _range_start(header: str | None) -> int:
    match = re.fullmatch(r"bytes=(\d+)-", header or "")
    return int(match.group(1)) if match else 0


def use_in_this_process(monkeypatch, url: str, cache: Path, offline: bool = False) -> None:
    """huggingface_hub of this process on the local Hub at `url` (HF_ENDPOINT is read once, at its import), with its
    cache in `cache`, no token but HF_TOKEN's, and online or not (HF_HUB_OFFLINE)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(cache / "no-token"))  # never a token saved by `hf auth login`
    monkeypatch.delenv("HF_TOKEN", raising=False)


def environment(url: str, cache: Path, origin: str = "") -> dict[str, str]:
    """The same for a child process (a block server, a gateway), in its environment; `origin` names it in the
    User-Agent of its requests (file_gets tells processes apart by it)."""
    return {"HF_ENDPOINT": url, "HF_HUB_CACHE": str(cache), "HF_TOKEN": "", "HF_HUB_OFFLINE": "0",
            "HF_TOKEN_PATH": str(cache / "no-token"), **({"HF_HUB_USER_AGENT_ORIGIN": origin} if origin else {})}
