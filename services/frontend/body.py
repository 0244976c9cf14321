"""Reading a request body as JSON: bounded in size, strict in what counts as JSON."""

from __future__ import annotations

import json

from starlette.requests import Request

from services.frontend.errors import ApiError


async def read_json(request: Request, limit: int) -> object:
    """The body parsed: 413 past `limit` bytes (declared or streamed), else see `parse_json`."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return parse_json(b"".join(chunks))


def parse_json(raw: bytes) -> object:
    """400 `invalid_json` for anything RFC 8259 does not call JSON: bytes that are not UTF-8,
    syntax errors, NaN/Infinity (Python's json takes them), nesting deeper than the parser's
    recursion limit, integers of more than 4300 digits."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the body is not UTF-8 text: {exc.reason} at byte {exc.start}",
                       code="invalid_json") from None
    try:
        return json.loads(text, parse_constant=_not_json)
    except RecursionError:
        raise ApiError(400, "malformed JSON body: nested too deeply", code="invalid_json") from None
    except ValueError as exc:
        raise ApiError(400, f"malformed JSON body: {exc}", code="invalid_json") from None


def _not_json(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than {limit} bytes", code="body_too_large")
