"""The steps of a request in a sampled stack: which piece of the mesh's work a CPU sample is.

A sample (py-spy's raw format: frames root first, `function (file:line)`, `;`-separated) is given
to the innermost frame that a step names, looking from the leaf towards the root, so the work a
library does for a step counts as that step (tokenizers' call under `tokenize`, protobuf's
serialization under the session frame that writes it). A sample no step names (the event loop's
own C code: epoll, callbacks, uvloop's socket writes; asyncio's task switching) is `event loop`.
Within one frame the first step listed that names it wins.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

EVENT_LOOP = "event loop (uvloop, asyncio, C)"

# (step, substrings of a frame's `function (file)`): the steps, as this code names them.
STEPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("session frames out (TCP or gRPC write)", ("Session._write (", "_ServerSession._write (", "_ServerSession._fill (",
                                         "_StreamRequestMixin", "SerializeToString", "_pack_")),
    ("session frames in (TCP or gRPC read)", ("Session._read (", "_ServerSession._read (", "_StreamResponseMixin",
                                       "Session._hand_out", "_unpack_", "FromString")),
    ("session calls: open, hand-off", ("session_client.py", "session_server.py", "local_session.py")),
    ("gRPC poller thread", ("Thread.run (threading.py", "_bootstrap_inner (threading.py")),
    ("metrics, tracing", ("prometheus_client/", "hop_latency.py", "fast_histogram.py", "mesh/tracing.py",
                          "opentelemetry/", "gc_pauses.py")),
    ("parse JSON body", ("frontend/body.py", "json/decoder.py", "json/__init__.py (loads")),
    ("validate", ("pydantic", "frontend/schemas.py", "processor/validation.py", "agent_schemas.py",
                  "frontend/qos.py")),
    ("chat template", ("chat_render.py", "jinja2/")),
    ("tokenize", ("processor/tokenizer.py",)),
    ("block hashes", ("kv_protocol/hashing.py", "xxhash")),
    ("admit", ("routing/admission/",)),
    ("route", ("services/routing/", "local_router.py")),
    ("engine: add, step, emit", ("engines/mocker/", "engines/output_channel.py", "worker/servicer.py",
                                 "decode_worker/service.py", "worker/pacing.py")),
    ("detokenize, choices", ("detokenizer.py", "byte_table.py", "choice_stream.py", "output_parsers.py")),
    ("processor: request", ("processor/service.py", "mesh/streams.py")),
    ("response: JSON/SSE, HTTP write", ("frontend/answer.py", "frontend/responses.py", "starlette/responses.py",
                                        "RequestResponseCycle.send", "messages_events.py", "responses_api.py",
                                        "json/encoder.py", "msgspec")),
    ("gateway: request, processor stream", ("frontend/app.py", "frontend/endpoints.py", "processor_stream.py",
                                            "frontend/inflight.py", "frontend/mesh.py")),
    ("HTTP: parse, ASGI", ("uvicorn/", "starlette/", "fastapi/", "httptools", "direct_write.py",
                           "fast_paths.py")),
)


def step_of(frames: list[str]) -> str:
    """The step of one sample (frames root first)."""
    for frame in reversed(frames):
        for step, marks in STEPS:
            if any(mark in frame for mark in marks):
                return step
    return EVENT_LOOP


def steps_of(raw_lines: Iterable[str]) -> Counter[str]:
    """Samples per step of py-spy's raw output (`frame;frame;... count` per line)."""
    counts: Counter[str] = Counter()
    for line in raw_lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if stack and count.isdigit():
            counts[step_of(stack.split(";"))] += int(count)
    return counts


def step_names() -> list[str]:
    return [step for step, _ in STEPS] + [EVENT_LOOP]
