"""What stands between the network and the endpoints: the API key (from a file or the environment, never only the
command line), and, when there is no key, the checks that keep web pages out of a loopback server; plus the
loading gate that answers while the model loads.

Without a key, a server on 127.0.0.1 is reachable from any web page the user opens: a page can POST a "simple"
request (text/plain, no preflight) and, by DNS rebinding (its own name re-pointed at 127.0.0.1), read the answers.
So a key-less server refuses a Host header that is not a loopback name or address (or the address it was bound
to), and refuses a POST whose body is not declared application/json, which a page cannot send without a CORS
preflight that this server answers only for origins given with --cors-origin.
"""
from __future__ import annotations

import hmac
import ipaddress
import os

from starlette.responses import JSONResponse

from edgellm.errors import EdgeLLMError

from .errors import HTTPError

API_KEY_ENV = "EDGELLM_API_KEY"
PUBLIC_PATHS = ("/health",)  # answered without a key, as llama-server does
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
LOOPBACK_NAMES = ("localhost",)


def resolve_api_key(flag: str | None = None, file: str | None = None, environ=None) -> str | None:
    """The API key from exactly one of --api-key, --api-key-file and $EDGELLM_API_KEY (None: no key). Two sources
    at once are refused rather than one silently winning. No message names the key itself."""
    environ = os.environ if environ is None else environ
    env = environ.get(API_KEY_ENV) or None
    given = [name for name, value in (("--api-key", flag), ("--api-key-file", file), (API_KEY_ENV, env))
             if value is not None]
    if len(given) > 1:
        raise EdgeLLMError(f"the API key is given by both {given[0]} and {given[1]}: give it one way only")
    if file is not None:
        try:
            with open(file, encoding="utf-8") as f:
                key = f.read().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise EdgeLLMError(f"cannot read the API key file {file!r}: {getattr(e, 'strerror', None) or e}") from None
        if not key:
            raise EdgeLLMError(f"the API key file {file!r} is empty")
        return _checked(key, file)
    if flag is not None:
        return _checked(flag, "--api-key")
    return _checked(env, API_KEY_ENV) if env is not None else None


def _checked(key: str, where: str) -> str:
    if not key or any(c.isspace() or not c.isprintable() for c in key):
        raise EdgeLLMError(f"the API key from {where} is empty or holds whitespace or control characters")
    return key


def _host_name(header: str) -> str:
    """The name part of a Host header: 'example.com:8080' -> 'example.com', '[::1]:80' -> '::1'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _ip(name: str):
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def host_allowed(header: str, bound_host: str) -> bool:
    """Whether a Host header names this server, not a name an attacker's DNS points at it: loopback names and
    addresses, the bound host, and (bound to every address) any IP literal, which DNS rebinding cannot forge."""
    name = _host_name(header)
    if name in LOOPBACK_NAMES or name.endswith(".localhost") or name == bound_host.lower().strip("[]"):
        return True
    ip = _ip(name)
    if ip is None:
        return False
    return ip.is_loopback or bound_host in WILDCARD_HOSTS


def _is_json(content_type: str) -> bool:
    return content_type.split(";", 1)[0].strip().lower() == "application/json"


class RequestGuard:
    """ASGI middleware: the API key check when there is a key, else the Host and Content-Type checks."""

    def __init__(self, app, api_key: str | None, bound_host: str = "127.0.0.1"):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.bound_host = bound_host

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope) -> HTTPError | None:
        headers = dict(scope.get("headers") or [])
        if self.expected is not None:
            if scope["path"] in PUBLIC_PATHS or hmac.compare_digest(headers.get(b"authorization", b""),
                                                                    self.expected):
                return None
            return HTTPError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                             code="invalid_api_key", kind="authentication_error")
        host = headers.get(b"host")
        if host is not None and not host_allowed(host.decode("latin-1"), self.bound_host):
            return HTTPError(403, "this server answers only requests addressed to it by a loopback name or its "
                                  "own address (a key-less server refuses other Host headers); start it with "
                                  "an API key to serve other names", code="host_not_allowed",
                             kind="permission_error")
        if scope["method"] == "POST" and not _is_json(headers.get(b"content-type", b"").decode("latin-1")):
            return HTTPError(415, "the request body must be sent as Content-Type: application/json",
                             code="unsupported_media_type")
        return None


class LoadingGate:
    """ASGI app that answers 503 (`{"status": "loading"}` on /health) until `app` is set, then hands over."""

    def __init__(self):
        self.app = None

    async def __call__(self, scope, receive, send):
        app = self.app
        if app is not None:
            await app(scope, receive, send)
            return
        if scope["type"] != "http":
            return  # lifespan events: nothing to start before the model is there
        error = HTTPError(503, "the model is loading", code="model_loading", kind="unavailable_error")
        body = {"status": "loading", "error": error.body()}
        await JSONResponse(body, status_code=503, headers=error.headers)(scope, receive, send)
