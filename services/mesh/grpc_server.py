"""gRPC servers with the mesh's defaults: health, optional reflection, mTLS, keepalive, message limits."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gen.kvmesh.v1 import common_pb2
from services.mesh.session_kind import CallError
from services.mesh.tls import TlsConfig

T = TypeVar("T")

# Messages carry whole prompts as token ids (and KV dumps later); 64 MiB keeps a 1M-token dump in.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
]


@dataclass(frozen=True)
class ServiceBinding:
    """One servicer to mount: the generated `add_*_to_server`, the servicer and its full name."""

    add_to_server: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    full_name: str


async def start_server(
    bindings: Sequence[ServiceBinding], host: str, port: int = 0, *,
    tls: TlsConfig | None = None, reflect: bool = False,
) -> tuple[grpc.aio.Server, int, health.HealthServicer]:
    """Starts a server with every binding plus grpc.health.v1 (and reflection when asked);
    with `tls` it accepts only clients whose certificate the mesh CA signed. Returns the port."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    for binding in bindings:
        binding.add_to_server(binding.servicer, server)
        names.append(binding.full_name)
    if reflect:
        reflection.enable_server_reflection(names, server)
    address = f"{host}:{port}"
    bound = (server.add_secure_port(address, tls.server_credentials()) if tls is not None
             else server.add_insecure_port(address))
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    await server.start()
    for binding in bindings:
        await health_servicer.set(binding.full_name, health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer


# A per-request RPC's end carries its outcome (common.proto's Outcome, by name) in this trailer,
# beside the gRPC status below that means the most to a plain gRPC client (grpcurl).
OUTCOME_KEY = "kvmesh-outcome"
# A refused request's field at fault (CallError.param) on a per-request RPC.
PARAM_KEY = "kvmesh-param"
# A request refused under overload: when a retry may fit, in milliseconds (CallError.retry_after_ms).
RETRY_AFTER_KEY = "retry-after-ms"

STATUS_OF: dict[common_pb2.Outcome, grpc.StatusCode] = {
    common_pb2.OUTCOME_PEER_GONE: grpc.StatusCode.UNAVAILABLE,
    common_pb2.OUTCOME_PEER_DRAINING: grpc.StatusCode.UNAVAILABLE,
    common_pb2.OUTCOME_PEER_FAILED: grpc.StatusCode.INTERNAL,
    common_pb2.OUTCOME_OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    common_pb2.OUTCOME_NO_CAPACITY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    common_pb2.OUTCOME_BAD_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    common_pb2.OUTCOME_CONTEXT_TOO_LONG: grpc.StatusCode.OUT_OF_RANGE,
    common_pb2.OUTCOME_NO_WORKER: grpc.StatusCode.NOT_FOUND,
    common_pb2.OUTCOME_MODEL_NOT_SERVED: grpc.StatusCode.NOT_FOUND,
    common_pb2.OUTCOME_DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    common_pb2.OUTCOME_READ_TOO_SLOWLY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    common_pb2.OUTCOME_CANCELLED: grpc.StatusCode.CANCELLED,
    common_pb2.OUTCOME_UNSUPPORTED: grpc.StatusCode.FAILED_PRECONDITION,
    common_pb2.OUTCOME_SESSION_FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


async def abort_with(context: grpc.aio.ServicerContext, exc: CallError) -> NoReturn:
    """Ends a per-request RPC with a `CallError`: its outcome's status, the outcome itself (and
    the field at fault, and when to retry) in the trailers."""
    trailers: tuple[tuple[str, str], ...] = ((OUTCOME_KEY, f"OUTCOME_{exc.outcome_name}"),)
    if exc.param:
        trailers += ((PARAM_KEY, exc.param),)
    if exc.retry_after_ms:
        trailers += ((RETRY_AFTER_KEY, str(exc.retry_after_ms)),)
    await context.abort(STATUS_OF.get(exc.outcome, grpc.StatusCode.UNKNOWN), exc.message, trailing_metadata=trailers)
    raise AssertionError("abort raises")


async def as_rpc(context: grpc.aio.ServicerContext, responses: AsyncIterator[T]) -> AsyncIterator[T]:
    """A session handler's responses as a per-request streaming RPC: a `CallError` becomes the
    call's status."""
    try:
        async for response in responses:
            yield response
    except CallError as exc:
        await abort_with(context, exc)


async def as_unary_rpc(context: grpc.aio.ServicerContext, responses: AsyncIterator[T]) -> T:
    """The one response of a session handler, as a unary RPC's answer."""
    async for response in as_rpc(context, responses):
        return response
    raise AssertionError("a unary handler yields one response")
