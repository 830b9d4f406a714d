"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, with the HTTP status that fits.

A request the client can fix is a 400 naming its field; a fault in the model or the server is a 500
(`server_error`), never a 400; an overloaded or loading server is a 503 with `Retry-After`."""
from __future__ import annotations

import re

from starlette.responses import JSONResponse

from edgellm.errors import (Cancelled, DeviceError, EdgeLLMError, GGUFError, MemoryBudgetError, ModelBusyError,
                            ModelError, NumericalError, PromptError, ServerClosing)

RETRY_AFTER_S = 1  # what a 503 asks the client to wait: a slot frees within a generation


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = dict(headers or {})
        if status == 503:
            self.headers.setdefault("Retry-After", str(RETRY_AFTER_S))

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.body()}, status_code=self.status, headers=self.headers)

    def body(self) -> dict:
        return {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}


def server_error(message: str = "internal server error", code: str = "internal_error") -> HTTPError:
    return HTTPError(500, message, code=code, kind="server_error")


def busy(message: str) -> HTTPError:
    return HTTPError(503, message, code="server_busy", kind="server_error")


def _is_model_fault(e: Exception) -> bool:
    # the model file or its numbers are at fault, not the request (a PromptError is a ModelError the client caused)
    if isinstance(e, PromptError):
        return False
    return isinstance(e, (NumericalError, GGUFError, ModelError, MemoryBudgetError, DeviceError, Cancelled))


def error_from_exception(e: Exception, fields) -> HTTPError:
    """An exception raised by a model call as an HTTPError: the request's fault (a 400 naming the field its message
    starts with, when it does), the model's (500), or a busy model (503)."""
    if isinstance(e, HTTPError):
        return e
    if isinstance(e, ServerClosing):
        return HTTPError(503, str(e), code="server_shutting_down", kind="server_error")
    if isinstance(e, ModelBusyError):
        return busy(f"the model is busy: {e}")
    if _is_model_fault(e):
        return server_error(f"the model failed: {e}", code="model_error")
    if not isinstance(e, (EdgeLLMError, TypeError, ValueError)):
        return server_error()  # an unknown fault: its text may hold internals, so it goes to the log only
    message = str(e).replace("create_chat_completion() got", "the request has").replace(
        "create_completion() got", "the request has")
    name = re.match(r"(\w+)", message)
    param = name.group(1) if name and name.group(1) in fields else None
    return HTTPError(400, message, param=param)
