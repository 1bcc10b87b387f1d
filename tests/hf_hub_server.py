"""A tiny Hugging Face Hub stand-in for tests: ``/{repo}/resolve/{revision}/{path}`` over HTTP.

It answers the HEAD + GET that ``huggingface_hub.hf_hub_download`` sends, with the headers the
hub uses (``X-Repo-Commit``, ``ETag``, ``X-Error-Code``), and enforces a bearer token: a request
without it gets the hub's 401 "repository not found". Point ``HF_ENDPOINT`` at ``endpoint``.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote


@dataclass
class FakeHub:
    """A running fake hub: one repo, a revision → commit map, files per commit, one token."""

    repo: str
    token: str
    files: dict[str, bytes]
    commit: str
    revisions: dict[str, str]
    server: ThreadingHTTPServer | None = None
    requests: list[tuple[str, str, bool]] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        """Base URL for ``HF_ENDPOINT``."""
        assert self.server is not None
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        """Shut the server down."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # keep test output quiet
            pass

        def _error(self, status: int, code: str, message: str) -> None:
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _serve(self, body: bool) -> None:
            authorized = self.headers.get("Authorization") == f"Bearer {hub.token}"
            hub.requests.append((self.command, self.path, authorized))
            prefix = f"/{hub.repo}/resolve/"
            path = unquote(self.path.split("?", 1)[0])
            if not path.startswith(prefix) or not authorized:
                # The hub hides private repos: no token looks exactly like no repo.
                return self._error(401, "RepoNotFound", "Repository Not Found")
            revision, _, filename = path[len(prefix) :].partition("/")
            if revision not in hub.revisions:
                return self._error(404, "RevisionNotFound", "Invalid rev id")
            if filename not in hub.files:
                return self._error(404, "EntryNotFound", "Entry not found")
            data = hub.files[filename]
            self.send_response(200)
            self.send_header("X-Repo-Commit", hub.revisions[revision])
            self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

    return Handler


def start_hf_hub(repo: str, files: dict[str, bytes], token: str) -> FakeHub:
    """Serve ``files`` of ``repo`` at revisions ``main`` and its commit sha, behind ``token``."""
    commit = hashlib.sha1(repr(sorted(files)).encode()).hexdigest()
    hub = FakeHub(repo, token, files, commit, {"main": commit, commit: commit})
    hub.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    threading.Thread(target=hub.server.serve_forever, daemon=True).start()
    return hub
