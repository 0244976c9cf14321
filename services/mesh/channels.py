"""gRPC client channels with the mesh's defaults, one per peer address, reused across requests."""

from __future__ import annotations

import grpc

from services.mesh.grpc_server import CHANNEL_OPTIONS
from services.mesh.tls import TlsConfig


def open_channel(address: str, tls: TlsConfig | None = None) -> grpc.aio.Channel:
    """A channel to a mesh peer: mutual TLS with the mesh CA when `tls` is set, else plaintext."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=CHANNEL_OPTIONS + tls.channel_options())


class ChannelPool:
    """One channel per address, reused across requests, closed with the owner."""

    def __init__(self, tls: TlsConfig | None = None) -> None:
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = open_channel(address, self._tls)
        return channel

    async def drop(self, address: str) -> None:
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        for address in list(self._channels):
            await self.drop(address)
