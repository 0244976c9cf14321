"""A worker's role on the wire (`WorkerRole`) and by name ("prefill", "decode", as flags and logs
say it): one mapping, so an unknown role is refused where it arrives instead of read as decode."""

from __future__ import annotations

from enum import StrEnum

import grpc

from gen.kvmesh.v1 import common_pb2
from gen.kvmesh.v1.common_pb2 import WorkerRole


class RoleName(StrEnum):
    """A worker role inside a process: its pool, what its flags and logs call it."""

    PREFILL = "prefill"
    DECODE = "decode"
    # Encodes images for the others (E/P/D); serves no generation, takes no role switch.
    ENCODE = "encode"


ROLE_NAMES: dict[WorkerRole, RoleName] = {common_pb2.WORKER_ROLE_DECODE: RoleName.DECODE,
                                          common_pb2.WORKER_ROLE_PREFILL: RoleName.PREFILL,
                                          common_pb2.WORKER_ROLE_ENCODE: RoleName.ENCODE}
ROLE_OF: dict[RoleName, WorkerRole] = {name: role for role, name in ROLE_NAMES.items()}


def role_name(role: WorkerRole) -> RoleName | None:
    """"prefill" or "decode"; None for an unspecified or unknown role."""
    return ROLE_NAMES.get(role)


# The roles a worker switches between.
SWITCHED_ROLES = (RoleName.PREFILL, RoleName.DECODE)


async def requested_role(role: WorkerRole, context: grpc.aio.ServicerContext,
                         allowed: tuple[RoleName, ...] = SWITCHED_ROLES) -> RoleName:
    """The name of the role an RPC asks for, one of `allowed`; an unspecified or unknown one ends
    the call with INVALID_ARGUMENT."""
    name = role_name(role)
    if name not in allowed:
        wire = " or ".join(common_pb2.WorkerRole.Name(ROLE_OF[r]) for r in allowed)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"role must be {wire}, got {role}")
        raise AssertionError("abort raises")
    return name
