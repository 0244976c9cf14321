"""The API key check: `Authorization: Bearer <key>` when the gateway has a key."""

from __future__ import annotations

import hmac

from services.frontend.errors import ApiError


def check_api_key(header: str | None, api_key: str | None) -> None:
    """401 unless the header is `Bearer <api_key>` (scheme case-insensitive); no check without a key.

    Any header at all is a 401 at worst, never an error: Starlette decodes header bytes as
    latin-1, so a non-ASCII byte arrives as a character above 127, and a str with one makes
    `hmac.compare_digest` raise. The comparison is of UTF-8 bytes, in constant time."""
    if api_key is None:
        return
    scheme, _, token = (header or "").strip().partition(" ")
    sent = token.strip().encode("utf-8", errors="replace")
    # compare_digest even for a wrong scheme: the time taken says nothing about the key.
    matches = hmac.compare_digest(sent, api_key.encode("utf-8"))
    if scheme.lower() != "bearer" or not sent or not matches:
        raise ApiError(401, "missing or invalid API key", code="invalid_api_key")
