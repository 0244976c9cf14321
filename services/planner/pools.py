"""The two worker pools the planner sizes, and what it may do to them."""

from __future__ import annotations

from dataclasses import dataclass

from services.config_error import ConfigError
from services.contract.worker_roles import RoleName

ROLES = (RoleName.PREFILL, RoleName.DECODE)


@dataclass(frozen=True)
class PoolSizes:
    """Workers per role."""

    prefill: int
    decode: int

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 0:
            raise ConfigError(f"pool sizes cannot be negative (prefill {self.prefill}, decode {self.decode})")

    @property
    def total(self) -> int:
        return self.prefill + self.decode

    def of(self, role: RoleName) -> int:
        return self.prefill if _checked(role) == RoleName.PREFILL else self.decode

    def with_role(self, role: RoleName, n: int) -> PoolSizes:
        return PoolSizes(n, self.decode) if _checked(role) == RoleName.PREFILL else PoolSizes(self.prefill, n)

    def __str__(self) -> str:
        return f"{self.prefill}P:{self.decode}D"


def _checked(role: RoleName) -> RoleName:
    """A role name; anything else is a bug to surface, not a decode pool to resize."""
    if role not in ROLES:
        raise ValueError(f"unknown worker role {role!r}: one of {', '.join(ROLES)}")
    return role
