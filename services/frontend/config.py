"""The gateway's settings, validated where they are made (frontend/flags.py builds them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.config_error import ConfigError
from services.frontend.auth import key_tenant
from services.frontend.images import ImageLimits
from services.frontend.qos import MAX_TENANT_CHARS
from services.frontend.short_names import check_short_name


@dataclass(frozen=True)
class FrontendConfig:
    # Any of these bearer tokens is accepted; none configured means no check.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # The tenant of each key, in the same order (admission's fair shares and limits).
    key_tenants: tuple[str, ...] = ()
    # A header that names the tenant instead (a trusted proxy sets it).
    tenant_header: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    max_inflight: int = 2048
    request_timeout_s: float = 600.0
    # Leave out x-kvmesh-worker, x-kvmesh-prefill and cached_tokens: which worker holds which
    # prefix (and that a prompt was cached, i.e. someone sent it before) is a side channel.
    hide_routing_details: bool = False
    # Serve /health, /live and /metrics on this port only (None: on the public port).
    metrics_port: int | None = None
    # Honour `x-kvmesh-explain: 1` with an `x-kvmesh-route` header (route_header.py).
    allow_explain: bool = False
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter answer (else 403): --allow-runtime-lora.
    allow_runtime_lora: bool = False
    # A request without x-session-id is in the session its `user` names: --session-from-user.
    session_from_user: bool = False
    # What image inputs are taken (--max-images, --max-image-bytes, --image-url-allow).
    images: ImageLimits = field(default_factory=ImageLimits)

    def __post_init__(self) -> None:
        for key in self.api_keys:
            if not key or not key.isascii() or not key.isprintable() or " " in key:
                raise ConfigError("--api-key: every key must be non-empty printable ASCII without spaces")
        if self.key_tenants and len(self.key_tenants) != len(self.api_keys):
            raise ConfigError("every API key needs its tenant")
        for tenant in self.key_tenants:
            check_short_name(tenant, "--api-key-file: a tenant", MAX_TENANT_CHARS)
        if self.tenant_header is not None and not self.tenant_header.strip():
            raise ConfigError("--tenant-header is empty")
        for flag, value in (("--max-body-bytes", self.max_body_bytes), ("--max-inflight", self.max_inflight)):
            if value <= 0:
                raise ConfigError(f"{flag} must be > 0, got {value}")
        if not self.request_timeout_s > 0:
            raise ConfigError(f"--request-timeout must be > 0, got {self.request_timeout_s}")
        if self.allow_explain and self.hide_routing_details:
            # Explaining a route tells which worker caches the prompt: the very detail hidden.
            raise ConfigError("--allow-explain contradicts --hide-routing-details")

    def tenant_of_key(self, index: int | None) -> str:
        """The tenant of the key that authenticated (by its index); "" (the default) without keys."""
        if index is None:
            return ""
        return self.key_tenants[index] if self.key_tenants else key_tenant(self.api_keys[index])
