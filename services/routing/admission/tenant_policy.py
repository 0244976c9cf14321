"""Tenants' weights and limits, from a TOML file the router reads again when it changes.

    [default]              # every tenant not named below (all keys optional)
    weight = 1.0           # its share inside a priority band, against the others' weights
    max_concurrency = 0    # requests in flight (waiting or running) at once; 0: no limit
    tokens_per_minute = 0  # prompt + max_tokens x choices admitted in any 60 s; 0: no limit
    top_priority = 0       # the lowest (soonest) priority its requests may take; a lower one is
                           # served as this (default: any)

    [tenants.acme]         # a tenant by name: the API key's tenant or the tenant header's value
    weight = 4
    max_concurrency = 64

A file that cannot be read or does not validate leaves the policy in force as it was (and says
so once per change of the file): a typo must not lift every limit at once.
"""

from __future__ import annotations

import logging
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType

from services.config_error import ConfigError

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class TenantPolicy:
    weight: float = 1.0
    max_concurrency: int = 0
    tokens_per_minute: int = 0
    # Priority is the client's to choose, so a tenant may be kept from jumping every band.
    top_priority: int = -(2**31)

    def __post_init__(self) -> None:
        if not (isinstance(self.weight, int | float) and math.isfinite(self.weight) and self.weight > 0):
            raise ConfigError(f"weight must be a number > 0, got {self.weight!r}")
        for name in ("max_concurrency", "tokens_per_minute"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be a whole number >= 0, got {value!r}")
        top = self.top_priority
        if not isinstance(top, int) or isinstance(top, bool) or not -(2**31) <= top < 2**31:
            raise ConfigError(f"top_priority must be a 32-bit whole number, got {top!r}")


@dataclass(frozen=True)
class TenantPolicies:
    default: TenantPolicy = field(default_factory=TenantPolicy)
    tenants: Mapping[str, TenantPolicy] = field(default_factory=lambda: MappingProxyType({}))

    def of(self, tenant: str) -> TenantPolicy:
        return self.tenants.get(tenant, self.default)

    @classmethod
    def parse(cls, text: str) -> TenantPolicies:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"not TOML: {exc}") from None
        unknown = sorted(set(data) - {"default", "tenants"})
        if unknown:
            raise ConfigError(f"unknown table [{unknown[0]}] (expected [default] and [tenants.NAME])")
        default = _policy(data.get("default", {}), "[default]")
        named = data.get("tenants", {})
        if not isinstance(named, dict):
            raise ConfigError("tenants must be a table of [tenants.NAME] tables")
        tenants = {name: _policy(value, f"[tenants.{name}]") for name, value in named.items()}
        return cls(default, MappingProxyType(tenants))


def _policy(data: object, where: str) -> TenantPolicy:
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a table")
    known = {f.name for f in fields(TenantPolicy)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    try:
        return TenantPolicy(**data)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


class PolicyFile:
    """The policies of a file, read again by `refresh` whenever its modification time or size
    changed (the router calls it once a second). Without a file: the defaults, for everyone."""

    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path else None
        self.policies = TenantPolicies()
        self.reloads = 0
        self.errors = 0
        self._seen: tuple[int, int] | None = None
        if self.path is not None:
            try:
                self.policies = TenantPolicies.parse(self.path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, ConfigError) as exc:
                raise ConfigError(f"--tenant-policies {self.path}: {exc}") from None
            self._seen = self._stamp()

    def _stamp(self) -> tuple[int, int] | None:
        assert self.path is not None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def refresh(self) -> bool:
        """Reads the file again if it changed; True when a new policy took effect."""
        if self.path is None:
            return False
        stamp = self._stamp()
        if stamp == self._seen:
            return False
        self._seen = stamp
        try:
            policies = TenantPolicies.parse(self.path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ConfigError) as exc:
            self.errors += 1
            log.error("--tenant-policies %s: %s; keeping the policy in force", self.path, exc)
            return False
        self.policies = policies
        self.reloads += 1
        log.info("--tenant-policies %s: reloaded (%d named tenants)", self.path, len(policies.tenants))
        return True
