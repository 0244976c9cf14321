"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status;
the Messages API's in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel
from starlette.responses import JSONResponse

from services.contract.outcomes import http_answer
from services.mesh.session_kind import CallError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}

# Anthropic's error type by status: the Messages API keeps the gateway's statuses (a 503, not
# Anthropic's own 529, for an overloaded or worker-less mesh) and names them as Anthropic does.
# Any other 4xx is an invalid_request_error, any other 5xx an api_error.
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

# How long a client should wait before retrying an overloaded or worker-less mesh.
RETRY_AFTER_S = 1


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """The body of every error response (published in the OpenAPI document)."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorBody(BaseModel):
    """The body of every error response of the Messages API (published in the OpenAPI document)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        # When a retry may fit (429 and 503): the mesh's own estimate, else RETRY_AFTER_S.
        self.retry_after_ms = retry_after_ms

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        """429 and 503 carry Retry-After in whole seconds (HTTP's unit, rounded up) and
        retry-after-ms (which OpenAI's clients read first); 401 says which scheme to use."""
        body = {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self._headers(headers))

    def anthropic_response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        """The same refusal in Anthropic's shape (the Messages API), with the same headers."""
        return JSONResponse(self.anthropic_body(), status_code=self.status, headers=self._headers(headers))

    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {"type": anthropic_type(self.status), "message": self.message}}

    def _headers(self, headers: dict[str, str] | None) -> dict[str, str]:
        out_headers = dict(headers or {})
        if self.status in (429, 503):
            retry_ms = self.retry_after_ms or RETRY_AFTER_S * 1000
            out_headers["retry-after"] = str(max(1, math.ceil(retry_ms / 1000)))
            out_headers["retry-after-ms"] = str(retry_ms)
        if self.status == 401:
            out_headers["www-authenticate"] = "Bearer"
        return out_headers


def anthropic_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def answered(exc: CallError) -> ApiError:
    """A call's outcome as the HTTP error the request is answered with (contract/outcomes.py)."""
    answer = http_answer(exc.outcome, exc.overload)
    return ApiError(answer.status, exc.message or exc.outcome_name, param=exc.param or None, code=answer.code,
                    retry_after_ms=exc.retry_after_ms)


def shown(exc: ApiError, hide_internals: bool) -> ApiError:
    """The error as the client may see it. A mesh failure's message names workers, processors
    and their addresses; with routing details hidden the client gets only what kind of failure
    it was (the full message is logged)."""
    if not hide_internals or exc.status < 500:
        return exc
    return ApiError(exc.status, f"the service could not complete the request ({exc.code})", code=exc.code,
                    retry_after_ms=exc.retry_after_ms)
