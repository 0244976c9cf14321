"""The API key check: `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`), any of the
gateway's keys, when it has some."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from pathlib import Path

from services.frontend.errors import ApiError
from services.config_error import ConfigError


# Anthropic's clients send the key in this header instead of Authorization.
X_API_KEY = "x-api-key"


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The credential a request presents, as an Authorization header: that header when it is
    there, else `x-api-key` as a bearer token (so one check serves both clients)."""
    authorization = headers.get("authorization")
    if authorization is not None:
        return authorization
    key = headers.get(X_API_KEY)
    return None if key is None else f"Bearer {key}"


def check_api_key(header: str | None, api_keys: tuple[str, ...]) -> int | None:
    """401 unless the header is `Bearer <one of api_keys>` (scheme case-insensitive); returns
    which key it was (its index), None without keys (no check).

    Any header at all is a 401 at worst, never an error: Starlette decodes header bytes as
    latin-1, so a non-ASCII byte arrives as a character above 127, and a str with one makes
    `hmac.compare_digest` raise. The comparison is of SHA-256 digests, in constant time, against
    every key (no early exit), so the time taken says neither whether nor which key matched."""
    if not api_keys:
        return None
    scheme, _, token = (header or "").strip().partition(" ")
    sent = token.strip().encode("utf-8", errors="replace")
    # Digests of equal length: compare_digest's time would otherwise depend on the key's length.
    digest = hashlib.sha256(sent).digest()
    matches = 0
    which = 0
    for i, key in enumerate(api_keys):
        match = hmac.compare_digest(digest, hashlib.sha256(key.encode("utf-8")).digest())
        matches |= match
        which += match * i  # arithmetic, not a branch: keys are distinct, so at most one adds
    # Compared even for a wrong scheme, for the same reason.
    if scheme.lower() != "bearer" or not sent or not matches:
        raise ApiError(401, "missing or invalid API key", code="invalid_api_key")
    return which


def load_api_keys(inline: str | None, key_file: str | None) -> dict[str, str]:
    """Keys from --api-key (comma-separated) and from --api-key-file (one per line, optionally
    followed by the key's tenant; blank lines and lines starting with '#' are skipped), each with
    its tenant. Several keys let one be rotated without downtime (give both the same tenant)."""
    keys = {k.strip(): key_tenant(k.strip()) for k in (inline or "").split(",") if k.strip()}
    if key_file:
        try:
            text = Path(key_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--api-key-file {key_file}: cannot read ({exc})") from None
        for number, line in enumerate(text.splitlines(), 1):
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            if len(words) > 2:
                raise ConfigError(f"--api-key-file {key_file}, line {number}: expected a key and at most a tenant")
            keys[words[0]] = words[1] if len(words) == 2 else key_tenant(words[0])
        if not keys:
            raise ConfigError(f"--api-key-file {key_file}: no keys in it")
    return keys


def key_tenant(key: str) -> str:
    """The tenant of a key given none: named after its digest, so the key itself never shows in
    metrics or logs."""
    return "key-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:12]
