"""What both ends of a multiplexed session agree on: the frame types, and how a call fails.

A session is one long-lived bidirectional gRPC stream between two processes that carries the
calls of many requests (the hot path: gateway -> processor, processor -> router, processor ->
decode worker). Frames down open calls (`calls`: stream id, deadline, trace metadata, request)
and cancel them (`cancel`); frames up carry replies (`replies`: stream id, response) and ends
(`ends`: StreamEnd). Each service's protos define its three frame messages with these field
names; `SessionKind` names them for the generic client and server. A kind may also carry rows
(`ReplyRows`): replies with nothing but tokens, packed as columns in `up.rows` for a caller that
set `down.accepts_rows` on its first frame (the worker session: `TokenRows`).

Rules both ends keep:
- a call's replies arrive in order, and all of them before its end;
- an end is sent once per call, except for a call the caller cancelled (it expects nothing);
- a session that breaks fails every call still open on it with UNAVAILABLE, never final, so
  callers retry or migrate each call as they would after a broken unary call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from gen.kvmesh.v1 import common_pb2, processor_pb2, router_pb2, worker_pb2

# Status codes by value, for StreamEnd.code.
CODES = {code.value[0]: code for code in grpc.StatusCode}
OK = grpc.StatusCode.OK.value[0]


TokenRow = list[int]
"""A worker's reply that carries output tokens and nothing else: what its handler yields for
every output but a call's first and last (and those with logprobs), packed into a frame's
`TokenRows` columns for a caller that reads them, so no message is built per token."""


@dataclass(frozen=True)
class ReplyRows:
    """Rows: replies a handler yields as `TokenRow`s, sent as one frame's columns to a caller
    that announced it reads them (`accepts_rows` on its first frame), as messages to any other."""

    to_message: Callable[[TokenRow], Any]

    @staticmethod
    def pack(frame: Any, stream_ids: list[int], rows: list[TokenRow]) -> None:
        columns = frame.rows
        columns.stream_ids.extend(stream_ids)
        columns.counts.extend([len(row) for row in rows])
        columns.token_ids.extend([token for row in rows for token in row])

    @staticmethod
    def unpack(frame: Any) -> Iterator[tuple[int, TokenRow]]:
        columns = frame.rows
        if not columns.stream_ids:
            return
        tokens = list(columns.token_ids)
        at = 0
        for sid, count in zip(columns.stream_ids, columns.counts):
            yield sid, tokens[at:at + count]
            at += count


@dataclass(frozen=True)
class SessionKind:
    """One service's session: its method and frame messages."""

    method: str  # "/kvmesh.v1.Worker/Session"
    down: type[Any]  # frames from the caller: repeated `calls`, repeated `cancel`
    up: type[Any]  # frames to the caller: repeated `replies`, repeated `ends`
    call: type[Any]  # one entry of `down.calls`
    # Set where plain replies may travel as columns (`up.rows`, `down.accepts_rows`).
    rows: ReplyRows | None = None

    @property
    def name(self) -> str:
        return self.method.rsplit("/", 2)[-2]


class CallError(Exception):
    """A call on a session (or the per-request RPC served by the same code) ended with a status.

    `final`: the service chose this answer, so the caller must not try the request elsewhere.
    `param`: for a refused request, the request field at fault (the HTTP error's `param`)."""

    def __init__(self, code: grpc.StatusCode, message: str, final: bool = False, param: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.final = final
        self.param = param

    def to_end(self, stream_id: int) -> common_pb2.StreamEnd:
        return common_pb2.StreamEnd(stream_id=stream_id, code=self.code.value[0], message=self.message,
                                    final=self.final, param=self.param)

    @staticmethod
    def from_end(end: common_pb2.StreamEnd) -> CallError:
        return CallError(CODES.get(end.code, grpc.StatusCode.UNKNOWN), end.message, end.final, end.param)


def final_error(code: grpc.StatusCode, message: str, param: str = "") -> CallError:
    return CallError(code, message, final=True, param=param)


@dataclass(frozen=True, slots=True)
class CallInfo:
    """What a handler knows of its call beyond the request: the caller's metadata (trace context)."""

    metadata: Mapping[str, str]


def call_info(context: grpc.aio.ServicerContext) -> CallInfo:
    """The CallInfo of a per-request RPC: its string metadata."""
    return CallInfo({k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)})


def token_row_message(row: TokenRow) -> worker_pb2.WorkerGenerateResponse:
    """A token row as the reply message it stands for."""
    return worker_pb2.WorkerGenerateResponse(token_ids=row)


WORKER_SESSION = SessionKind("/kvmesh.v1.Worker/Session", worker_pb2.WorkerSessionDown, worker_pb2.WorkerSessionUp,
                             worker_pb2.WorkerCall, ReplyRows(token_row_message))
PROCESSOR_SESSION = SessionKind("/kvmesh.v1.Processor/Session", processor_pb2.ProcessorSessionDown,
                                processor_pb2.ProcessorSessionUp, processor_pb2.ProcessorCall)
ROUTER_SESSION = SessionKind("/kvmesh.v1.Router/Session", router_pb2.RouterSessionDown, router_pb2.RouterSessionUp,
                             router_pb2.RouterCall)
