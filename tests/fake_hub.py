"""A local HTTP server that speaks the Hugging Face Hub endpoints huggingface_hub calls for a download, so the Hub
tests run without the internet.

  GET  /api/models/{repo}[/revision/{rev}]      model info; with ?blobs=true each sibling's size and LFS sha256
  HEAD /{repo}/resolve/{rev}/{path}              302 to the "CDN" (a second server: another origin, as the Hub's
  GET  /{repo}/resolve/{rev}/{path}              LFS storage is) with ETag, X-Repo-Commit, X-Linked-Etag, X-Linked-Size
  GET  {cdn}/cdn/{repo}/{path}                   the bytes, honouring Range (206 + Content-Range)

No X-Xet-* header or xet Link is ever sent, so the client downloads over plain HTTP. Per file the server can drop
the connection part-way through the first GET (a transfer to resume), serve bytes whose sha256 differs from the
one it lists (a corrupt transfer), or refuse requests without a token (a gated repository: 401 GatedRepo).
"""
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


@dataclass
class FakeRepo:
    files: dict                      # path -> bytes
    sha: str = "0123456789abcdef0123456789abcdef01234567"
    gated: bool = False
    corrupt: set = field(default_factory=set)      # paths served with one byte flipped
    drop_at: dict = field(default_factory=dict)    # path -> byte offset where the first GET is cut off

    def sha256(self, path):
        return hashlib.sha256(self.files[path]).hexdigest()


class FakeHub:
    def __init__(self):
        self.repos: dict[str, FakeRepo] = {}
        # (method, path, Range header, Authorization header); method "BYTES" where file bytes were sent
        self.log: list[tuple] = []
        self._lock = threading.Lock()
        self._servers = [ThreadingHTTPServer(("127.0.0.1", 0), _handler(self)) for _ in range(2)]
        self.url, self.cdn_url = (f"http://127.0.0.1:{s.server_address[1]}" for s in self._servers)
        for s in self._servers:
            s.daemon_threads = True
            threading.Thread(target=s.serve_forever, daemon=True).start()

    def stop(self):
        for s in self._servers:
            s.shutdown()
            s.server_close()

    def record(self, *entry):
        with self._lock:
            self.log.append(entry)

    def downloads(self, name=None):
        """Full-file or resumed GETs (not the header's ranged reads from byte 0), optionally of one file name."""
        return [e for e in self.log if e[0] == "BYTES" and not (e[2] or "").startswith("bytes=0-")
                and (name is None or e[1].endswith("/" + name))]


_CDN = re.compile(r"^/cdn/(?P<repo>[^/]+/[^/]+)/(?P<path>.+)$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+?)(?:/revision/(?P<rev>[^/]+))?$")


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _send(self, status, body=b"", headers=None, head=False):
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _error(self, status, code, message, head=False, extra=None):
            body = json.dumps({"error": message}).encode()
            self._send(status, b"" if head else body, {"X-Error-Code": code, "X-Error-Message": message,
                                                        "Content-Type": "application/json", **(extra or {})}, head)

        def do_GET(self):
            self._serve(head=False)

        def do_HEAD(self):
            self._serve(head=True)

        def _serve(self, head):
            url = urlsplit(self.path)
            path = unquote(url.path)
            hub.record(self.command, path, self.headers.get("Range"), self.headers.get("Authorization"))
            m = _INFO.match(path)
            if m and not head:
                return self._info(m["repo"], m["rev"] or "main", "blobs=true" in url.query)
            m = _RESOLVE.match(path)
            if m:
                return self._resolve(m["repo"], m["rev"], m["path"], head)
            m = _CDN.match(path)
            if m and m["repo"] in hub.repos and m["path"] in hub.repos[m["repo"]].files:
                return self._bytes(hub.repos[m["repo"]], m["path"], head)
            self._error(404, "NotFound", f"no route {path}", head)

        def _info(self, repo_id, rev, blobs):
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._error(404, "RepoNotFound", "Repository not found")
            if rev not in ("main", repo.sha):
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            siblings = []
            for p, data in sorted(repo.files.items()):
                s = {"rfilename": p}
                if blobs:
                    s.update(size=len(data), blobId=hashlib.sha1(data).hexdigest(),
                             lfs={"size": len(data), "sha256": repo.sha256(p), "pointerSize": 134})
                siblings.append(s)
            body = {"_id": "x", "id": repo_id, "modelId": repo_id, "sha": repo.sha, "private": False,
                    "gated": "manual" if repo.gated else False, "disabled": False, "tags": ["gguf"],
                    "downloads": 0, "likes": 0, "siblings": siblings, "lastModified": "2026-01-01T00:00:00.000Z",
                    "createdAt": "2026-01-01T00:00:00.000Z"}
            self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})

        def _resolve(self, repo_id, rev, path, head):
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._error(404, "RepoNotFound", "Repository not found", head)
            if repo.gated and not self.headers.get("Authorization"):
                return self._error(401, "GatedRepo", "Access to this model is restricted. You must have access "
                                   "to it and be authenticated to access it. Please log in.", head)
            if rev not in ("main", repo.sha):
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
            if path not in repo.files:
                return self._error(404, "EntryNotFound", "Entry not found", head, {"X-Repo-Commit": repo.sha})
            size = len(repo.files[path])
            etag = f'"{repo.sha256(path)}"'
            self._send(302, b"", {"Location": f"{hub.cdn_url}/cdn/{repo_id}/{path}", "ETag": etag,
                                  "X-Linked-Etag": etag, "X-Linked-Size": str(size), "X-Repo-Commit": repo.sha},
                       head=head)

        def _bytes(self, repo, path, head):
            data = repo.files[path]
            if path in repo.corrupt:
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            common = {"ETag": f'"{repo.sha256(path)}"', "Accept-Ranges": "bytes",
                      "Content-Type": "application/octet-stream"}
            if head:
                return self._send(200, data, common, head=True)
            rng = self.headers.get("Range")
            hub.record("BYTES", self.path, rng, self.headers.get("Authorization"))
            if rng:
                m = re.match(r"bytes=(\d+)-(\d*)$", rng)
                start, end = int(m[1]), (int(m[2]) + 1 if m[2] else len(data))
                end = min(end, len(data))
                return self._send(206, data[start:end], {**common, "Content-Range": f"bytes {start}-{end - 1}/{len(data)}"})
            cut = repo.drop_at.pop(path, None)
            if cut is not None:  # the whole file announced, part of it sent, then the connection dropped
                self.send_response(200)
                for k, v in common.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data[:cut])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)
                return
            self._send(200, data, common)

    return Handler
