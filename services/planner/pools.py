"""The worker pools the planner sizes, and what it may do to them: the prefill and decode pools
(sized, and switched between: a worker takes either role) and the encode pool (E/P/D; sized by
starting and stopping its workers, whose engine runs the encoder alone)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from services.config_error import ConfigError
from services.contract.worker_roles import SWITCHED_ROLES, RoleName

ROLES = SWITCHED_ROLES
# Every pool the planner sizes.
SIZED_ROLES = (*ROLES, RoleName.ENCODE)
_FIELDS = {RoleName.PREFILL: "prefill", RoleName.DECODE: "decode", RoleName.ENCODE: "encode"}


@dataclass(frozen=True)
class PoolSizes:
    """Workers per role."""

    prefill: int
    decode: int
    encode: int = 0

    def __post_init__(self) -> None:
        if self.prefill < 0 or self.decode < 0 or self.encode < 0:
            raise ConfigError(f"pool sizes cannot be negative (prefill {self.prefill}, decode {self.decode}, "
                              f"encode {self.encode})")

    @property
    def total(self) -> int:
        """The prefill and decode workers (those a fixed budget counts)."""
        return self.prefill + self.decode

    def of(self, role: RoleName) -> int:
        return int(getattr(self, _field(role)))

    def with_role(self, role: RoleName, n: int) -> PoolSizes:
        return replace(self, **{_field(role): n})

    def __str__(self) -> str:
        encode = f"{self.encode}E:" if self.encode else ""
        return f"{encode}{self.prefill}P:{self.decode}D"


def _field(role: RoleName) -> str:
    """A role's field; anything else is a bug to surface, not a decode pool to resize."""
    name = _FIELDS.get(role)
    if name is None:
        raise ValueError(f"unknown worker role {role!r}: one of {', '.join(SIZED_ROLES)}")
    return name
