"""Errors as the OpenAI API gives them: a status and `{"error": {message, type, param, code}}`.

Every answer the server gives to a request it cannot carry out is an `APIError`: 400 for a
request that does not fit (naming the field), 401 for a missing key, 404 for an unknown
model, 413 for a body over the limit, 503 (with `Retry-After`) when it admits no more, 500
only when a stage failed or an executor died while running a good request.
"""

from __future__ import annotations

import re

from starlette.responses import JSONResponse

from omniflow.errors import OmniflowError

TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


# An object's default repr names its address ("<_io.BytesIO object at 0x7f...>", as
# Pillow's "cannot identify image file" does): nothing a client should see.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
MAX_MESSAGE_CHARS = 4096  # a message echoing a huge value is cut


def public(message: str) -> str:
    """`message` as a client may see it: no object addresses, at most MAX_MESSAGE_CHARS."""
    message = _ADDRESS.sub("", message)
    if len(message) > MAX_MESSAGE_CHARS:
        cut = len(message) - MAX_MESSAGE_CHARS
        message = f"{message[:MAX_MESSAGE_CHARS]}... ({cut} characters more)"
    return message


class APIError(OmniflowError):
    """An answer other than 200: its status, message, the request field it is about
    (`param`) and a machine-readable `code`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        message = public(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, *, param=None, code=None) -> dict:
    kind = TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": public(message), "type": kind, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def busy(message: str, retry_after: int = 1) -> APIError:
    """503 with `Retry-After`: the server admits no more requests now (or is stopping)."""
    return APIError(503, message, code="server_busy", headers={"Retry-After": str(retry_after)})
