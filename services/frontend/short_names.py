"""Names a request or a setting hands the gateway that travel on into etcd keys, metrics labels and
logs (a session id, a tenant): short printable ASCII, checked in one place. A bad one is refused
naming where it came from: a ConfigError for a setting, a 400 for a request's header or field."""

from __future__ import annotations

from services.config_error import ConfigError
from services.frontend.errors import ApiError


def is_short_name(name: str, max_chars: int, without: str = "") -> bool:
    """Whether `name` is 1 to `max_chars` printable ASCII characters with none of `without`."""
    return (bool(name) and len(name) <= max_chars and name.isascii() and name.isprintable()
            and not any(c in name for c in without))


def check_short_name(name: str, what: str, max_chars: int, without: str = "") -> None:
    """ConfigError naming `what` unless `name` is a short name (`is_short_name`)."""
    if not is_short_name(name, max_chars, without):
        but = f" without {', '.join(repr(c) for c in without)}" if without else ""
        raise ConfigError(f"{what} must be 1-{max_chars} printable ASCII characters{but}, got {name[:80]!r}")


def request_name(value: str, where: str, max_chars: int, without: str = "") -> str:
    """A request's header or body field `where` holding such a name: the name, stripped; else a 400
    naming `where`."""
    name = value.strip()
    try:
        check_short_name(name, where, max_chars, without)
    except ConfigError as exc:
        raise ApiError(400, str(exc), param=where, code="invalid_value") from None
    return name
