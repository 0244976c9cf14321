"""A request's answer after routing: processor deltas to SSE chunks or one JSON body.

`Answer.close` ends the request exactly once on every path (normal end, upstream error, client
gone, streaming never started): it cancels the processor calls, releases the in-flight lease and
counts the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gen.kvmesh.v1 import processor_pb2
from services.frontend.direct_write import BodyWriter
from services.frontend.endpoints import CHAT, COMPLETION, Kind
from services.frontend.errors import ApiError, shown
from services.frontend.inflight import Lease
from services.frontend.metrics import FrontendMetrics
from services.frontend.processor_stream import ProcessorStream
from services.frontend.responses import (
    finish_name,
    SSE_DONE,
    ChoiceAccumulator,
    TextEvents,
    add_agent_delta,
    chat_logprobs,
    completion_logprobs,
    sse,
    usage_body,
)
from services.mesh.session_kind import TextRow, text_row_message
from services.mesh.streams import merge
from services.mesh.tasks import cancel_and_wait

log = logging.getLogger(__name__)
T = TypeVar("T")


async def first_route(streams: list[ProcessorStream]) -> processor_pb2.RouteInfo:
    """Opens every prompt's stream at once (their prefills run side by side); the first one's
    routing answers for the request's headers. Failures before routing are HTTP errors."""
    opening = [asyncio.ensure_future(stream.open()) for stream in streams]
    try:
        routes = await asyncio.gather(*opening)
    except BaseException:
        await cancel_and_wait(*opening)
        raise
    return routes[0]


class Answer:
    """The rest of a request after routing: deltas to SSE chunks or one JSON body."""

    def __init__(self, metrics: FrontendMetrics, kind: Kind, req, rid: str,
                 streams: list[ProcessorStream], started: float, lease: Lease, hide_details: bool = False,
                 first_shown: Callable[[float], None] | None = None) -> None:
        self.hide_details = hide_details
        # Told the time to first token when the first delta is shown (admission's OutsideQueue).
        self._first_shown = first_shown
        self.metrics = metrics
        self.kind = kind
        self.req = req
        self.streams = streams
        self.started = started
        self.lease = lease
        self.id = kind.id_prefix + rid
        self.created = int(time.time())
        self.usage = processor_pb2.Usage()
        self.status = "200"
        self._closed = False
        # When the last delta a client can see was shown (None before the first).
        self._last_shown: float | None = None
        # Read once: every chunk of the stream asks.
        self.include_usage = req.include_usage

    def close(self) -> None:
        """Ends the request once: cancels what still runs, frees its in-flight share, counts it."""
        if self._closed:
            return
        self._closed = True
        for stream in self.streams:
            stream.cancel()
        self.lease.release()
        metrics = self.metrics
        metrics.duration.observe(time.perf_counter() - self.started)
        metrics.requests.labels(self.kind.endpoint, self.status).inc()
        metrics.completion_tokens.inc(self.usage.completion_tokens)
        metrics.prompt_tokens.inc(self.usage.prompt_tokens)

    def items(self) -> AsyncIterator[processor_pb2.ChoiceDelta]:
        """The choices' deltas that show something; usage is complete when they end."""
        return self._items(rows=False)  # type: ignore[return-value]

    async def _items(self, rows: bool) -> AsyncIterator[processor_pb2.ChoiceDelta | TextRow]:
        """`items`, where `rows` leaves text rows (session_kind.TextRow) as they came."""
        streams = [s.messages() for s in self.streams]
        try:
            # One prompt (most requests): its stream as it is, one generator fewer per delta.
            async for msg in streams[0] if len(streams) == 1 else merge(streams):
                if isinstance(msg, tuple):
                    if not msg[1]:
                        continue  # tokens still forming a character: nothing to show yet
                    self._shown()
                    yield msg if rows else text_row_message(msg).delta
                    continue
                which = msg.WhichOneof("kind")
                if which == "delta":
                    d = msg.delta
                    if not (d.text or d.finish_reason or d.logprobs or d.reasoning or d.tool_calls):
                        continue  # tokens still forming a character: nothing to show yet
                    self._shown()
                    yield d
                elif which == "usage":
                    u = self.usage
                    u.prompt_tokens += msg.usage.prompt_tokens
                    u.completion_tokens += msg.usage.completion_tokens
                    u.cached_tokens += msg.usage.cached_tokens
        except ApiError as error:
            self.status = str(error.status)
            log.warning("request %s: %d mid-stream: %s", self.id, error.status, error.message)
            raise
        finally:
            self.close()

    def _shown(self) -> None:
        """Records a visible delta's time to first token, or its time since the previous one."""
        now = time.perf_counter()
        if self._last_shown is None:
            self.metrics.ttft.observe(now - self.started)
            if self._first_shown is not None:
                self._first_shown(now - self.started)
        else:
            self.metrics.itl.observe(now - self._last_shown)
        self._last_shown = now

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": self.kind.chunk_name, "created": self.created, "model": self.req.model,
                "choices": choices}
        if self.include_usage:
            body["usage"] = usage
        return body

    def _choice_chunk(self, index: int, delta: dict | str, logprobs: dict | None = None, finish: str | None = None
                      ) -> dict:
        """A streamed chunk of one choice: `delta` is a chat delta, or a completion's text."""
        if self.kind is CHAT:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": delta, "finish_reason": finish, "logprobs": logprobs}
        return self._chunk([choice])

    def _text_chunk(self, index: int, text: str) -> dict:
        """The chunk of a plain text delta, after a chat choice's first (which names the role)."""
        return self._choice_chunk(index, {"content": text} if self.kind is CHAT else text)

    async def sse(self, writer: BodyWriter | None = None) -> AsyncIterator[bytes]:
        """The stream's SSE events. With a `writer` (direct_write.py), a one-prompt stream's text
        rows are written to the connection where they arrive, while this waits for its next
        response with every event before them sent (the writer's condition for keeping order)."""
        is_chat = self.kind is CHAT
        opened: set[int] = set()
        plain = TextEvents(self._text_chunk)
        # One prompt's stream: its rows' frame times tell what this hop adds (hop_latency.py).
        source = self.streams[0] if len(self.streams) == 1 else None
        hop = self.metrics.hop
        if source is not None and writer is not None:
            source.sink_rows(self._row_writer(writer, source, plain, opened))
        try:
            async for item in self._items(rows=True):
                if isinstance(item, tuple):
                    events = self._text_event(item, plain, opened)
                    if events is not None:
                        # Most events of a stream: a text row, with the rows already behind it
                        # (a gateway that fell behind catches up in fewer, larger writes).
                        origin = source.frame_ns if source is not None else 0
                        if source is not None and (more := source.ready_rows()):
                            events = b"".join([events, *self._row_events(more, plain, opened)])
                        yield events
                        if origin:  # the events are with the connection now
                            hop.record(origin, time.time_ns())
                        continue
                    d = text_row_message(item).delta  # a chat choice's first text
                else:
                    d = item
                if not (d.finish_reason or d.logprobs or d.reasoning or d.tool_calls) and (not is_chat or d.index in opened):
                    yield plain.event(d.index, d.text)  # most events of a stream: text only
                    continue
                yield self._delta_event(d, opened)
            if self.include_usage:
                yield sse(self._chunk([], usage_body(self.usage, self.hide_details)))
        except ApiError as exc:
            exc = shown(exc, self.hide_details)
            yield sse({"error": {"message": exc.message, "type": "server_error", "param": None, "code": exc.code}})
        yield SSE_DONE

    def _row_writer(self, writer: BodyWriter, source: ProcessorStream, plain: TextEvents, opened: set[int]
                    ) -> Callable[[TextRow], bool]:
        """Writes a text row's event to the connection (ProcessorStream.sink_rows); declines a
        chat choice's first text (its event names the role) and whatever the writer declines."""
        hop, shown, text_event = self.metrics.hop, self._shown, self._text_event

        def write(row: TextRow) -> bool:
            if not row[1]:
                return True  # tokens still forming a character: nothing to show yet
            event = text_event(row, plain, opened)
            if event is None or not writer.write(event):
                return False
            shown()
            if origin := source.frame_ns:
                hop.record(origin, time.time_ns())
            return True

        return write

    def _row_events(self, rows: list[TextRow], plain: TextEvents, opened: set[int]) -> list[bytes]:
        """The events of rows taken behind a row being sent (empty texts show nothing)."""
        events = []
        for row in rows:
            if row[1]:
                self._shown()
                events.append(self._text_event(row, plain, opened)
                              or self._delta_event(text_row_message(row).delta, opened))
        return events

    def _text_event(self, row: TextRow, plain: TextEvents, opened: set[int]) -> bytes | None:
        """A text row's event from its choice's template; None for a chat choice's first text,
        whose event names the role (`_delta_event`)."""
        if self.kind is CHAT and row[0] not in opened:
            return None
        return plain.event(row[0], row[1])

    def _delta_event(self, d: processor_pb2.ChoiceDelta, opened: set[int]) -> bytes:
        """A delta's event built in full: a chat choice's first (with the role), or one with a
        finish reason, logprobs, reasoning or tool calls."""
        if self.kind is CHAT:
            delta: dict = {"content": d.text}
            if d.reasoning or d.tool_calls:
                add_agent_delta(delta, d)
            if d.index not in opened:
                opened.add(d.index)
                delta["role"] = "assistant"
            chunk = self._choice_chunk(d.index, delta, chat_logprobs([d]) if d.logprobs else None,
                                       finish_name(d.finish_reason))
        else:
            chunk = self._choice_chunk(d.index, d.text, completion_logprobs([d]) if d.logprobs else None,
                                       finish_name(d.finish_reason))
        return sse(chunk)

    async def collect(self) -> dict:
        choices: dict[int, ChoiceAccumulator] = {}
        async for d in self.items():
            acc = choices.setdefault(d.index, ChoiceAccumulator())
            acc.text.append(d.text)
            if d.reasoning or d.tool_calls:
                acc.add_agent_parts(d)
            if d.logprobs:
                acc.tokens.append(d)
            if d.finish_reason:
                acc.finish_reason = finish_name(d.finish_reason)
            if d.stop_sequence:
                acc.stop_sequence = d.stop_sequence
        out = []
        for index in sorted(choices):
            acc = choices[index]
            text = "".join(acc.text)
            if self.kind is not COMPLETION:
                out.append({"index": index, "message": acc.message(text),
                            "logprobs": chat_logprobs(acc.tokens) if self.req.logprobs else None,
                            "finish_reason": acc.finish_reason})
            else:
                out.append({"index": index, "text": text, "finish_reason": acc.finish_reason,
                            "logprobs": completion_logprobs(acc.tokens) if self.req.logprobs is not None else None})
            if acc.stop_sequence is not None:
                out[-1]["stop_reason"] = acc.stop_sequence  # vLLM's field: which stop string ended it
        return {"id": self.id, "object": self.kind.object_name, "created": self.created, "model": self.req.model,
                "choices": out, "usage": usage_body(self.usage, self.hide_details)}


class SseResponse(StreamingResponse):
    """A StreamingResponse that always ends its request: Starlette may stop iterating the body
    (client gone, send failed, task cancelled) without closing it, or before starting it."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], **kwargs: object) -> None:
        super().__init__(content, **kwargs)  # type: ignore[arg-type]
        self._content = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            await self._content.aclose()  # type: ignore[attr-defined]


# nginx's "client closed request": what the metrics count for a client that left first.
CLIENT_GONE = 499


class ClientGone(Exception):
    """The client hung up before its answer was complete: nobody is there to read a response."""


async def unless_gone(work: Awaitable[T], receive: Receive, on_gone: Callable[[], None] = lambda: None) -> T:
    """`work`'s result, unless the client hangs up first: then `on_gone` runs, the work is
    cancelled (nothing is generated for nobody: the cancellation reaches the processor, the
    decode worker and the prefill worker) and ApiError(499) is raised."""
    working = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({working, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not working.done():
            on_gone()
            await cancel_and_wait(working)
    if working.cancelled():
        raise ApiError(CLIENT_GONE, "the client closed the connection", code="client_closed")
    return working.result()


async def collect_unless_gone(answer: Answer, receive: Receive) -> dict:
    """The whole answer's body. Raises the ApiError that ended it, or ClientGone when the client
    hung up first (the request is then cancelled rather than generated for nobody, and ended)."""

    def gone() -> None:
        answer.status = str(CLIENT_GONE)

    try:
        return await unless_gone(answer.collect(), receive, gone)
    except ApiError as exc:
        if exc.status == CLIENT_GONE:
            answer.close()
            raise ClientGone from None
        raise


async def _disconnected(receive: Receive) -> None:
    """Returns when the client disconnects (the body is read: nothing else can arrive)."""
    while (await receive())["type"] != "http.disconnect":
        pass
