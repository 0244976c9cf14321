"""What carries a session's frames (session_kind.py): a plain TCP connection beside gRPC, or the
service's gRPC `Session` stream.

Why: a message on a `grpc.aio` stream costs each end tens of microseconds of CPU (the
completion queue's poller thread hands every write and read to the event loop), which made the
session messages the largest share of a request's CPU across the mesh (bench/hot_path/
request_profile.py). The same frame as a length-prefixed write on a TCP socket costs a few.

The protocol, per connection (TLS with the mesh's certificates where the mesh uses TLS: a client
certificate the CA signed is required, as on the gRPC port):
- the caller's hello: one frame holding the session method's full name
  (`kvmesh.v1.Worker/Session`); the server answers one frame `ACCEPTED`, or closes the connection
  for a method it does not serve;
- then frames both ways, each a 4-byte little-endian length and the serialized frame message
  (the kind's `down` from the caller, `up` from the server), exactly what the gRPC stream
  carries. Closing the connection ends the session (the caller's calls fail OUTCOME_PEER_GONE).

A caller learns the port from the peer's gRPC server (`SessionCarrier.Endpoint`). A peer that
does not implement it, offers no port, or whose port cannot be reached gets the session over
its gRPC stream as before (logged; that peer's port is not tried again for
`UNREACHABLE_RETRY_S`), so a mesh mixing versions, or a network that lets only the gRPC port
through, still works. A frame of length 0 is a heartbeat (`Liveness`): each end writes one after
`HEARTBEAT_S` without writing and cuts the connection after `SILENT_PEER_S` without reading, so
a stopped peer process is found as a gRPC keepalive would find it; a vanished host is also
found by TCP keepalive (`KEEPALIVE_*`), and a write nobody acknowledges fails after
`USER_TIMEOUT_MS`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

import grpc

from gen.kvmesh.v1 import carrier_pb2, carrier_pb2_grpc
from services.mesh.channels import ChannelPool
from services.mesh.grpc_server import MAX_MESSAGE_BYTES, ServiceBinding
from services.mesh.session_server import SessionHub
from services.mesh.tls import TlsConfig

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = MAX_MESSAGE_BYTES
MAX_HELLO_BYTES = 256
ACCEPTED = b"\x01"
CONNECT_TIMEOUT_S = 5.0
HELLO_TIMEOUT_S = 5.0
# As the gRPC channels' keepalive (grpc_server.CHANNEL_OPTIONS): probe after 10 s of silence,
# give up 5 s later.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 10, 5, 1
USER_TIMEOUT_MS = 15_000
# How long a peer whose carrier port could not be used gets its sessions over gRPC before the
# port is tried again.
UNREACHABLE_RETRY_S = 60.0
# Each end writes an empty frame after this long without writing, and takes the other for gone
# after SILENT_PEER_S without reading anything: a peer process that stopped (SIGSTOP, a hang)
# while its host's kernel still acknowledges, which TCP keepalive cannot tell from a live one.
HEARTBEAT_S = 5.0
SILENT_PEER_S = 15.0
_EMPTY_FRAME = _HEADER.pack(0)
SERVICE_NAME = carrier_pb2.DESCRIPTOR.services_by_name["SessionCarrier"].full_name


class Carrier(Protocol):
    """A session's connection as its calling end sees it."""

    name: str

    async def write(self, frame: Any) -> None: ...

    async def read(self) -> Any | None:
        """The next frame from the peer; None once it closed the session."""

    def cancel(self) -> None: ...


class GrpcCarrier:
    """The session over the service's gRPC `Session` stream."""

    name = "grpc"

    def __init__(self, channel: grpc.aio.Channel, method: str, down: Any, up: Any) -> None:
        self._call = channel.stream_stream(method, request_serializer=down.SerializeToString,
                                           response_deserializer=up.FromString)()

    async def write(self, frame: Any) -> None:
        await self._call.write(frame)

    async def read(self) -> Any | None:
        frame = await self._call.read()
        return None if frame is grpc.aio.EOF else frame

    def cancel(self) -> None:
        self._call.cancel()


class Liveness:
    """One end of a TCP connection's heartbeat (HEARTBEAT_S, SILENT_PEER_S): its watch task is
    the connection's, stopped with it."""

    def __init__(self, writer: asyncio.StreamWriter, peer: str) -> None:
        self._writer = writer
        self._peer = peer
        self._loop = asyncio.get_running_loop()
        self.last_read = self.last_write = self._loop.time()
        self._watch_task = self._loop.create_task(self._watch(), name=f"session heartbeat {peer}")

    def read(self) -> None:
        self.last_read = self._loop.time()

    def wrote(self) -> None:
        self.last_write = self._loop.time()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            now = self._loop.time()
            if now - self.last_read > SILENT_PEER_S:
                log.warning("session connection with %s: nothing read for %.0f s; taken for gone", self._peer,
                            now - self.last_read)
                self._writer.transport.abort()
                return
            if now - self.last_write >= HEARTBEAT_S:
                self._writer.write(_EMPTY_FRAME)  # a few bytes: no wait for the buffer to drain
                self.last_write = now

    def stop(self) -> None:
        self._watch_task.cancel()


class TcpCarrier:
    """The session over its own TCP connection, at either end: frames of `incoming` (the kind's
    `up` at the caller, `down` at the server) in, any frame out, and the heartbeat both ways."""

    name = "tcp"

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, incoming: Any,
                 peer: str) -> None:
        self._reader = reader
        self._writer = writer
        self._parse = incoming.FromString
        self._live = Liveness(writer, peer)

    async def write(self, frame: Any) -> None:
        write_frame(self._writer, frame.SerializeToString())
        self._live.wrote()
        await self._writer.drain()

    async def read(self) -> Any | None:
        while True:
            data = await read_frame(self._reader, MAX_FRAME_BYTES)
            self._live.read()
            if data is None:
                return None
            if data:  # an empty frame is the peer's heartbeat
                return self._parse(data)

    async def frames(self) -> AsyncIterator[Any]:
        """Every frame until the peer closes (what a SessionHub serves)."""
        while (frame := await self.read()) is not None:
            yield frame

    def cancel(self) -> None:
        self._live.stop()
        self._writer.transport.abort()

    def close(self) -> None:
        """Ends the connection after what was written (a session that ended)."""
        self._live.stop()
        self._writer.close()


def write_frame(writer: asyncio.StreamWriter, payload: bytes) -> None:
    writer.write(_HEADER.pack(len(payload)) + payload)


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes | None:
    """The next frame's bytes; None at a clean end (the peer closed between frames)."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ConnectionError("the peer closed the connection inside a frame header") from None
    (size,) = _HEADER.unpack(header)
    if size > max_bytes:
        raise ConnectionError(f"a frame of {size} bytes is over the {max_bytes}-byte limit")
    try:
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise ConnectionError("the peer closed the connection inside a frame") from None


def _tune(writer: asyncio.StreamWriter) -> None:
    """No Nagle delay (frames are flushed once per loop turn already); a silent peer is found."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                          ("TCP_KEEPCNT", KEEPALIVE_PROBES), ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS)):
        if hasattr(socket, option):  # Linux has them all; elsewhere the system's defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _host(address: str) -> str:
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") else host


class CarrierDialer:
    """Opens the calling end of sessions over TCP where the peer offers it."""

    def __init__(self, channels: ChannelPool, tls: TlsConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._channels = channels
        self._tls = tls
        self._ssl = tls.client_ssl_context() if tls is not None else None
        self._clock = clock
        # Peers whose carrier port could not be used, until when: their next sessions go over
        # gRPC at once instead of waiting out a connect that a firewall may drop again.
        self._unreachable: dict[str, float] = {}

    async def open(self, address: str, method: str, up: Any) -> TcpCarrier | None:
        """A TCP carrier to `address`'s sessions of `method`; None where the peer offers none or
        it cannot be reached (the caller uses the gRPC stream). Raises ConnectionError when the
        peer's gRPC server does not answer at all (the session fails as a broken stream would)."""
        if self._unreachable.get(address, 0.0) > self._clock():
            return None  # its port failed lately: not asked again yet
        try:
            endpoint = await carrier_pb2_grpc.SessionCarrierStub(self._channels.get(address)).Endpoint(
                carrier_pb2.CarrierRequest(), timeout=CONNECT_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                return None  # a peer from before the TCP carrier
            raise ConnectionError(f"{address}: {exc.code().name} {exc.details()}") from None
        if not endpoint.port:
            return None
        host = _host(address)
        try:
            return await asyncio.wait_for(self._connect(host, endpoint.port, method, up), CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError, ValueError) as exc:  # ssl.SSLError and ConnectionError are OSErrors
            self._unreachable[address] = self._clock() + UNREACHABLE_RETRY_S
            log.warning("sessions to %s: its TCP carrier at port %d cannot be used (%s); over gRPC instead for "
                        "%.0f s", address, endpoint.port, exc or type(exc).__name__, UNREACHABLE_RETRY_S)
            return None

    async def _connect(self, host: str, port: int, method: str, up: Any) -> TcpCarrier:
        server_hostname = None
        if self._ssl is not None:
            server_hostname = (self._tls.server_name if self._tls is not None else None) or host
        reader, writer = await asyncio.open_connection(host, port, ssl=self._ssl, server_hostname=server_hostname)
        try:
            _tune(writer)
            write_frame(writer, method.encode())
            await writer.drain()
            if await read_frame(reader, MAX_HELLO_BYTES) != ACCEPTED:
                raise ConnectionError(f"the peer does not serve {method} there")
        except BaseException:
            writer.transport.abort()
            raise
        return TcpCarrier(reader, writer, up, f"{host}:{port}")


class CarrierListener:
    """The serving end: sessions of this process's hubs over TCP, on a port of their own."""

    def __init__(self, hubs: Sequence[SessionHub], tls: TlsConfig | None = None) -> None:
        self._hubs = {hub.kind.method: hub for hub in hubs}
        self._ssl = tls.server_ssl_context() if tls is not None else None
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._cutting = False

    async def start(self, host: str) -> int:
        """Listens on `host` (a free port; one socket, as the gRPC server binds `host`: a name
        that resolves to several addresses takes the first, `::` takes IPv4 too); returns the port."""
        family = socket.getaddrinfo(host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        sock = socket.create_server((host, 0), family=family,
                                    dualstack_ipv6=family == socket.AF_INET6 and socket.has_dualstack_ipv6())
        self._server = await asyncio.start_server(self._serve, sock=sock, ssl=self._ssl,
                                                  ssl_handshake_timeout=HELLO_TIMEOUT_S if self._ssl else None)
        return sock.getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            _tune(writer)
            hello = await asyncio.wait_for(read_frame(reader, MAX_HELLO_BYTES), HELLO_TIMEOUT_S)
            hub = self._hubs.get(hello.decode(errors="replace")) if hello is not None else None
            if hub is None:
                return
            write_frame(writer, ACCEPTED)
            await writer.drain()
            connection = TcpCarrier(reader, writer, hub.kind.down, str(writer.get_extra_info("peername")))
            try:
                await hub.serve(connection.frames(), connection)
            finally:
                connection.close()
        except (OSError, TimeoutError) as exc:  # ConnectionError and ssl.SSLError are OSErrors
            log.debug("a session connection ended: %s", exc or type(exc).__name__)
        except asyncio.CancelledError:
            # Cut by `stop` past its grace: ended here, since asyncio's server logs a cancelled
            # connection task as an ERROR ("Exception in callback ...connection_made").
            if not self._cutting:
                raise
            log.debug("a session connection was cut at the server's stop")
        finally:
            self._connections.discard(task)
            writer.close()

    async def stop(self, grace_s: float) -> None:
        """Takes no new connection; sessions get `grace_s` to end (their hubs drain them), then
        are cut."""
        if self._server is not None:
            self._server.close()
        open_now = set(self._connections)
        if open_now:
            await asyncio.wait(open_now, timeout=grace_s)
        self._cutting = True
        for task in open_now:
            task.cancel()
        await asyncio.gather(*open_now, return_exceptions=True)


def endpoint_binding(port: int) -> ServiceBinding:
    """The gRPC service that tells callers where this process's carrier listens (`port`; 0: none)."""
    return ServiceBinding(carrier_pb2_grpc.add_SessionCarrierServicer_to_server, _Endpoint(port), SERVICE_NAME)


class _Endpoint(carrier_pb2_grpc.SessionCarrierServicer):
    def __init__(self, port: int) -> None:
        self._reply = carrier_pb2.CarrierEndpoint(port=port)

    async def Endpoint(self, request: carrier_pb2.CarrierRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> carrier_pb2.CarrierEndpoint:
        return self._reply
