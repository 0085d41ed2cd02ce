"""Errors in OpenAI's JSON shape, so every client library shows them as it shows OpenAI's."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

# The ``type`` OpenAI gives each status; clients branch on the status, people read the type.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "unavailable_error",
}

_MAX_MESSAGE_CHARS = 1000


class APIError(Exception):
    """A request refused or failed: ``status`` for HTTP, the rest for the JSON body.

    ``param`` names the request field at fault (``"messages[2].content"``), ``code`` is a
    short machine-readable reason (``"queue_full"``)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(param: str, message: str) -> APIError:
    """A 400 about one field; ``message`` reads ``"<param> = <value>: must be ..."``. Cut
    to a bounded length: it may quote a value of any size from the request."""
    if len(message) > _MAX_MESSAGE_CHARS:
        message = message[: _MAX_MESSAGE_CHARS - 1] + "…"
    return APIError(400, message, param=param, code="invalid_value")
