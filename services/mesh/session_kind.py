"""What both ends of a multiplexed session agree on: the frame types, and how a call fails.

A session is one long-lived bidirectional gRPC stream between two processes that carries the
calls of many requests (every hop of a request: gateway -> processor, processor -> router,
processor -> decode worker, decode worker -> router and -> prefill worker). Frames down open
calls (`calls`: stream id, deadline, trace metadata, request) and cancel them (`cancel`); frames
up carry replies (`replies`: stream id, response) and ends (`ends`: StreamEnd with the call's
outcome). Each service's protos define its three frame messages with these field
names; `SessionKind` names them for the generic client and server. A kind may also carry rows
(`ReplyRows`): replies with nothing but tokens, packed as columns in `up.rows` for a caller that
set `down.accepts_rows` on its first frame (the worker session: `TokenRows`; the processor
session: `TextRows`).

Rules both ends keep:
- a call's replies arrive in order, and all of them before its end;
- an end is sent once per call, except for a call the caller cancelled (it expects nothing);
- a session that breaks fails every call still open on it with OUTCOME_PEER_GONE, so callers
  retry or migrate each call as they would after a broken unary call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

import grpc

from gen.kvmesh.v1 import common_pb2, processor_pb2, router_pb2, worker_pb2

Outcome: TypeAlias = common_pb2.Outcome
OK = common_pb2.OUTCOME_OK


TokenRow = list[int]
"""A worker's reply that carries output tokens and nothing else: what its handler yields for
every output but a call's first and last (and those with logprobs), packed into a frame's
`TokenRows` columns for a caller that reads them, so no message is built per token."""

TextRow = tuple[int, str, list[int]]
"""A processor's reply that carries one choice's text and tokens and nothing else: (choice
index, text, token ids), packed into a frame's `TextRows` columns for a caller that reads them."""


@dataclass(frozen=True)
class ReplyRows:
    """Rows: replies a handler yields as instances of `row_type`, sent as one frame's columns
    (`up.rows`) to a caller that announced it reads them (`accepts_rows` on its first frame), as
    the messages they stand for (`to_message`) to any other."""

    row_type: type
    pack: Callable[[Any, list[int], list[Any]], None]
    unpack: Callable[[Any], Iterator[tuple[int, Any]]]
    to_message: Callable[[Any], Any]
    # Rows a caller hands out between two turns of its loop (0: a frame's rows at once).
    per_slice: int = 0


def _pack_tokens(frame: Any, stream_ids: list[int], rows: list[TokenRow]) -> None:
    columns = frame.rows
    columns.stream_ids.extend(stream_ids)
    columns.counts.extend([len(row) for row in rows])
    columns.token_ids.extend([token for row in rows for token in row])


def _token_slices(columns: Any) -> Iterator[list[int]]:
    """Each row's tokens: the next `counts[i]` entries of `token_ids`."""
    tokens = list(columns.token_ids)
    at = 0
    for count in columns.counts:
        yield tokens[at:at + count]
        at += count


def _unpack_tokens(frame: Any) -> Iterator[tuple[int, TokenRow]]:
    columns = frame.rows
    return zip(columns.stream_ids, _token_slices(columns))


def _pack_texts(frame: Any, stream_ids: list[int], rows: list[TextRow]) -> None:
    columns = frame.rows
    columns.stream_ids.extend(stream_ids)
    columns.indexes.extend([row[0] for row in rows])
    columns.texts.extend([row[1] for row in rows])
    columns.counts.extend([len(row[2]) for row in rows])
    columns.token_ids.extend([token for row in rows for token in row[2]])


def _unpack_texts(frame: Any) -> Iterator[tuple[int, TextRow]]:
    columns = frame.rows
    for sid, index, text, ids in zip(columns.stream_ids, columns.indexes, columns.texts, _token_slices(columns)):
        yield sid, (index, text, ids)


def token_row_message(row: TokenRow) -> worker_pb2.WorkerGenerateResponse:
    """A token row as the reply message it stands for."""
    return worker_pb2.WorkerGenerateResponse(token_ids=row)


def text_row_message(row: TextRow) -> processor_pb2.GenerateResponse:
    """A text row as the reply message it stands for."""
    index, text, ids = row
    return processor_pb2.GenerateResponse(delta=processor_pb2.ChoiceDelta(index=index, text=text, token_ids=ids))


# A processor hands a worker frame's rows out at once: what they make for a gateway then leaves
# as one frame, not one per slice.
TOKEN_ROWS = ReplyRows(list, _pack_tokens, _unpack_tokens, token_row_message)
# A gateway writes each row to a socket where it hands it out: a frame of a few thousand streams
# is taken in slices (as vLLM's output loop takes 128 outputs), so it never holds the loop long.
TEXT_ROWS = ReplyRows(tuple, _pack_texts, _unpack_texts, text_row_message, per_slice=128)


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
    """A call on a session (or the per-request RPC served by the same code) ended otherwise than
    OK, and how: its `outcome` (common.proto's Outcome). What a caller does about each outcome is
    decided in services/contract/outcomes.py, nowhere else.

    `param`: for a refused request, the request field at fault (the HTTP error's `param`).
    `retry_after_ms` and `overload`: for a request refused under overload, when a retry may fit
    and why it was refused (the HTTP Retry-After and error code)."""

    def __init__(self, outcome: Outcome, message: str, param: str = "", retry_after_ms: int = 0,
                 overload: common_pb2.Overload = common_pb2.OVERLOAD_UNSPECIFIED) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message
        self.param = param
        self.retry_after_ms = retry_after_ms
        self.overload = overload

    @property
    def outcome_name(self) -> str:
        """"PEER_GONE", "BAD_REQUEST", ...: for log lines (a newer peer's outcome by number)."""
        return outcome_name(self.outcome)

    def to_end(self, stream_id: int) -> common_pb2.StreamEnd:
        return common_pb2.StreamEnd(stream_id=stream_id, outcome=self.outcome, message=self.message,
                                    param=self.param, retry_after_ms=self.retry_after_ms, overload=self.overload)

    @staticmethod
    def from_end(end: common_pb2.StreamEnd) -> CallError:
        return CallError(end.outcome, end.message, end.param, end.retry_after_ms, end.overload)


def outcome_name(outcome: int) -> str:
    """An outcome's name without its prefix; one this process does not know (a newer peer's) by number."""
    try:
        return common_pb2.Outcome.Name(outcome).removeprefix("OUTCOME_")  # type: ignore[arg-type]
    except ValueError:
        return str(outcome)


def bad_request(message: str, param: str = "") -> CallError:
    """The request is wrong (`param`: the field at fault): the caller answers with it."""
    return CallError(common_pb2.OUTCOME_BAD_REQUEST, message, param)


@dataclass(frozen=True, slots=True)
class CallInfo:
    """What a handler knows of its call beyond the request: the caller's metadata (trace context),
    and on a session `reply`: the call's outbox itself, for a reply made outside the handler's
    generator (a row made where a worker's frame is read). It may be used only while the
    handler waits with every reply it yielded already taken, so replies stay in order; it drops
    replies once the call has ended."""

    metadata: Mapping[str, str]
    reply: Callable[[Any], None] | None = None


def call_info(context: grpc.aio.ServicerContext) -> CallInfo:
    """The CallInfo of a per-request RPC: its string metadata."""
    return CallInfo({k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)})


WORKER_SESSION = SessionKind("/kvmesh.v1.Worker/Session", worker_pb2.WorkerSessionDown, worker_pb2.WorkerSessionUp,
                             worker_pb2.WorkerCall, TOKEN_ROWS)
PROCESSOR_SESSION = SessionKind("/kvmesh.v1.Processor/Session", processor_pb2.ProcessorSessionDown,
                                processor_pb2.ProcessorSessionUp, processor_pb2.ProcessorCall, TEXT_ROWS)
ROUTER_SESSION = SessionKind("/kvmesh.v1.Router/Session", router_pb2.RouterSessionDown, router_pb2.RouterSessionUp,
                             router_pb2.RouterCall)
PREFILL_SESSION = SessionKind("/kvmesh.v1.Prefiller/Session", worker_pb2.PrefillSessionDown,
                              worker_pb2.PrefillSessionUp, worker_pb2.PrefillCall)
