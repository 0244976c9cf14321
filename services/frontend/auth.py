"""The API key check: `Authorization: Bearer <key>`, any of the gateway's keys, when it has some."""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from services.frontend.errors import ApiError
from services.mesh.config_error import ConfigError


def check_api_key(header: str | None, api_keys: tuple[str, ...]) -> None:
    """401 unless the header is `Bearer <one of api_keys>` (scheme case-insensitive); no check without keys.

    Any header at all is a 401 at worst, never an error: Starlette decodes header bytes as
    latin-1, so a non-ASCII byte arrives as a character above 127, and a str with one makes
    `hmac.compare_digest` raise. The comparison is of SHA-256 digests, in constant time, against
    every key (no early exit), so the time taken says neither whether nor which key matched."""
    if not api_keys:
        return
    scheme, _, token = (header or "").strip().partition(" ")
    sent = token.strip().encode("utf-8", errors="replace")
    # Digests of equal length: compare_digest's time would otherwise depend on the key's length.
    digest = hashlib.sha256(sent).digest()
    matches = 0
    for key in api_keys:
        matches |= hmac.compare_digest(digest, hashlib.sha256(key.encode("utf-8")).digest())
    # Compared even for a wrong scheme, for the same reason.
    if scheme.lower() != "bearer" or not sent or not matches:
        raise ApiError(401, "missing or invalid API key", code="invalid_api_key")


def load_api_keys(inline: str | None, key_file: str | None) -> tuple[str, ...]:
    """Keys from --api-key (comma-separated) and from --api-key-file (one per line; blank lines
    and lines starting with '#' are skipped). Several keys let one be rotated without downtime."""
    keys = [k.strip() for k in (inline or "").split(",") if k.strip()]
    if key_file:
        try:
            text = Path(key_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--api-key-file {key_file}: cannot read ({exc})") from None
        keys += [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
        if not keys:
            raise ConfigError(f"--api-key-file {key_file}: no keys in it")
    return tuple(dict.fromkeys(keys))
