"""gRPC servers with the mesh's defaults: health, optional reflection, mTLS, keepalive, message limits."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

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


# Trailing metadata on an error a service chose to return ("this request is bad", "no worker
# can take it"), as opposed to one from a process that died or a connection that broke: a
# caller must not try the same request on another instance.
FINAL_ERROR_KEY = "kvmesh-final-error"
# A refused request's field at fault (CallError.param) on a per-request RPC.
PARAM_KEY = "kvmesh-param"
# A request refused under overload: when a retry may fit, in milliseconds (CallError.retry_after_ms).
RETRY_AFTER_KEY = "retry-after-ms"


async def abort_final(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    """Ends the call with an error the caller must take as the answer (see FINAL_ERROR_KEY)."""
    await context.abort(code, details, trailing_metadata=((FINAL_ERROR_KEY, "1"),))
    raise AssertionError("abort raises")


def is_final(exc: grpc.aio.AioRpcError) -> bool:
    return any(key == FINAL_ERROR_KEY for key, _ in (exc.trailing_metadata() or ()))


async def abort_with(context: grpc.aio.ServicerContext, exc: CallError) -> NoReturn:
    """Ends a per-request RPC with a `CallError`'s status (final ones marked with FINAL_ERROR_KEY)."""
    trailers: tuple[tuple[str, str], ...] = ((FINAL_ERROR_KEY, "1"),) if exc.final else ()
    if exc.param:
        trailers += ((PARAM_KEY, exc.param),)
    if exc.retry_after_ms:
        trailers += ((RETRY_AFTER_KEY, str(exc.retry_after_ms)),)
    await context.abort(exc.code, exc.message, trailing_metadata=trailers)
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
