"""One prompt's stream of choices from a processor, carried over when that processor fails.

The processor holds a stream's state (tokens so far, detokenizer, stop strings), so a processor
that dies would take its streams with it. The gateway keeps what it needs to take a stream over
instead:

- before the first message (the route) arrives, a failure sends the same request to another
  processor;
- after it, the request goes to another processor with `resume`: for every choice not finished
  yet, the token ids the client already received. The new processor runs only those choices,
  continuing each after its tokens without sending their text again (decode workers continue a
  sequence exactly), so the client sees one stream.

Which outcomes move the stream and which are its answer is the outcome table's
(services/contract/outcomes.py, hop PROCESSOR): a processor gone, draining or failing is moved
from; what a processor answers (bad input, no worker for the model, overload) is the answer.
Processors moved from are kept out of the gateway's choices for a while (RecentFailures), not
only until their lease expires.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable

from gen.kvmesh.v1 import processor_pb2
from services.contract.outcomes import Action, Hop, verdict
from services.frontend.errors import ApiError, answered
from services.frontend.mesh import MeshView
from services.mesh.recent_failures import RecentFailures
from services.mesh.session_client import SessionStream
from services.mesh.session_kind import CallError, TextRow
from services.mesh.tracing import outgoing_metadata

log = logging.getLogger(__name__)

# Processors tried per stream, counting the first; each failure excludes the one that failed.
MAX_PROCESSORS_PER_STREAM = 4


class ProcessorStream:
    def __init__(self, mesh: MeshView, request: processor_pb2.GenerateRequest, timeout_s: float,
                 failures: RecentFailures) -> None:
        self._mesh = mesh
        self._request = request
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        self._failures = failures
        self._tried: list[str] = []
        self._call: SessionStream | None = None
        self._route: processor_pb2.RouteInfo | None = None
        self._cancelled = False
        self._processor = ""
        first, n = request.choice_offset, max(request.n, 1)
        # Per choice the client sees: token ids delivered so far, and whether it finished.
        self._tokens: dict[int, list[int]] = {i: [] for i in range(first, first + n)}
        self._finished: set[int] = set()
        self.took_over = False
        self._row_sink: Callable[[TextRow], bool] | None = None

    @property
    def frame_ns(self) -> int:
        """When the processor wrote the frame of the response read last: where this hop's
        latency counts from (hop_latency.py)."""
        return self._call.frame_ns if self._call is not None else 0

    def ready_rows(self) -> list[TextRow]:
        """The text rows already here and next in line, taken now (kept for a takeover like any)."""
        if self._call is None:
            return []
        rows = self._call.take_ready(tuple)
        for row in rows:
            self._delivered(row)
        return rows

    def sink_rows(self, sink: Callable[[TextRow], bool]) -> None:
        """Text rows go to `sink` where the processor's frame is read, while the reader of
        `messages` waits with nothing unread (SessionStream.sink): on this call and on any a
        takeover opens. A row the sink took counts as delivered (kept for a takeover)."""
        def take(row: TextRow) -> bool:
            if sink(row):
                self._delivered(row)
                return True
            return False

        self._row_sink = take
        if self._call is not None:
            self._call.sink = take

    def cancel(self) -> None:
        """Ends the stream for good: a call cancelled here is not a processor failure."""
        self._cancelled = True
        # The sink refers back to the request's answer: let both go with the request.
        self._row_sink = None
        if self._call is not None:
            self._call.sink = None
            self._call.cancel()

    async def open(self) -> processor_pb2.RouteInfo:
        """Sends the request to a processor and returns its routing; ApiError when none can take it."""
        self._route = await self._open(self._request)
        return self._route

    async def messages(self) -> AsyncIterator[processor_pb2.GenerateResponse | TextRow]:
        """Deltas (text rows among them) and the usage after `open`, across as many processors as
        it takes."""
        while True:
            assert self._call is not None
            try:
                async for msg in self._read(self._call):
                    yield msg
                return
            except CallError as exc:
                if not self._moves(exc, started=True) or len(self._tried) >= MAX_PROCESSORS_PER_STREAM:
                    raise answered(exc) from None
                if len(self._finished) == len(self._tokens):
                    # Every choice had finished; only the usage was lost with the processor.
                    yield self._usage(processor_pb2.GenerateResponse(usage=processor_pb2.Usage(
                        prompt_tokens=self._route.prompt_tokens if self._route else 0)))
                    return
                log.warning("request %s: processor %s failed mid-stream (%s); taking the stream over elsewhere",
                            self._request.request_id, self._processor, exc.outcome_name)
                self.took_over = True
                await self._open(self._takeover_request())

    def _delivered(self, row: TextRow) -> None:
        """A text row is the client's: its tokens are kept for a takeover."""
        self._tokens[row[0]].extend(row[2])

    async def _read(self, call: SessionStream) -> AsyncIterator[processor_pb2.GenerateResponse | TextRow]:
        async for msg in call:
            if type(msg) is tuple:  # a text row: a delta with text and tokens only
                self._delivered(msg)
                yield msg
                continue
            which = msg.WhichOneof("kind")
            if which == "delta":
                delta = msg.delta
                self._tokens[delta.index].extend(delta.token_ids)
                if delta.finish_reason:
                    self._finished.add(delta.index)
                yield msg
            elif which == "usage":
                yield self._usage(msg) if self.took_over else msg

    def _usage(self, msg: processor_pb2.GenerateResponse) -> processor_pb2.GenerateResponse:
        """After a takeover the last processor counts only the choices it ran: count them all here."""
        out = processor_pb2.GenerateResponse()
        out.CopyFrom(msg)
        out.usage.completion_tokens = sum(len(t) for t in self._tokens.values())
        return out

    def _takeover_request(self) -> processor_pb2.GenerateRequest:
        request = processor_pb2.GenerateRequest()
        request.CopyFrom(self._request)
        # A fresh id: the failed processor's own calls may still be winding down under the old
        # one. "^" keeps it apart from the ids a processor gives a migrated choice ("~k").
        request.request_id = f"{self._request.request_id}^{len(self._tried)}"
        request.resume.extend(processor_pb2.ResumedChoice(index=i, token_ids=t)
                              for i, t in self._tokens.items() if i not in self._finished)
        return request

    async def _open(self, request: processor_pb2.GenerateRequest) -> processor_pb2.RouteInfo:
        last: CallError | None = None
        while len(self._tried) < MAX_PROCESSORS_PER_STREAM:
            chosen = self._mesh.processor_for(request.model, exclude=self._tried,
                                                  avoid=self._failures.current())
            if chosen is None:
                break
            self._processor, session = chosen
            self._tried.append(self._processor)
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                raise ApiError(503, f"the request took longer than {self._timeout_s:.0f}s", code="timeout")
            # The request's span is current (request_tracing.py): the processor's joins its trace.
            self._call = call = session.open(request, remaining, outgoing_metadata())
            call.sink = self._row_sink
            if self._cancelled:
                call.cancel()
            try:
                msg = await anext(call, None)
            except CallError as exc:
                if not self._moves(exc, started=False):
                    raise answered(exc) from None
                last = exc
                log.warning("request %s: processor %s failed before answering (%s); trying another",
                            request.request_id, self._processor, exc.outcome_name)
                continue
            if msg is None or msg.WhichOneof("kind") != "route":
                raise ApiError(503, "the processor closed the stream before routing", code="unavailable")
            return msg.route
        if last is not None:
            raise ApiError(503, f"no processor could take the request: {last.message or last.outcome_name}",
                           code="unavailable")
        raise ApiError(503, f"no processor serves {request.model[:200]!r} right now", code="unavailable")

    def _moves(self, exc: CallError, started: bool) -> bool:
        """Whether the stream goes on at another processor (the outcome table); the processor
        is set aside where the table says so."""
        if self._cancelled:
            return False
        judged = verdict(Hop.PROCESSOR, exc.outcome, started)
        if judged.set_aside:
            self._failures.add(self._processor)
        return judged.action is not Action.ANSWER
