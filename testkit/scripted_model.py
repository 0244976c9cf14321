"""A scripted model behind the Messages and Responses APIs, to record what agent clients send on
the turns a random-weights model never reaches: tool calls (two at once, one failing), their
results, and the answer after them.

It is not a stand-in for the mesh: the recorder (testkit/recorder.py) sits in front of it while a
real Claude Code or Codex runs a task, and the request bodies it records become the fixtures that
tests replay to the real gateway (tests/fixtures/agents/). The script, per conversation:
- a request whose conversation holds no tool result yet: two tool calls at once, reading
  `notes.txt` and a file that does not exist (the client answers the second with an error);
- any later request: a one-line text answer, with reasoning (a thinking block, or a reasoning
  item whose encrypted_content the gateway can decode, as the gateway writes it);
- a request without tools (a client's side task, e.g. a title): a short text answer.

    python -m testkit.scripted_model --port 8200 --workdir /path/with/notes.txt
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

from aiohttp import web

from services.frontend.responses_input import encode_reasoning
from testkit.http_server import application, serve_until_signal

ANSWER = "The notes say the deploy moved to Tuesday for another database migration review."
REASONING = "The file was read; one line is enough."


def _sse(kind: str, data: dict, named: bool = True) -> bytes:
    head = f"event: {kind}\n".encode() if named else b""
    return head + b"data: " + json.dumps(data).encode() + b"\n\n"


def _has_tool_result_messages(body: dict) -> bool:
    return any(isinstance(m.get("content"), list) and any(b.get("type") == "tool_result" for b in m["content"])
               for m in body.get("messages", []) if isinstance(m, dict))


def _has_tool_result_items(body: dict) -> bool:
    items = body.get("input")
    return isinstance(items, list) and any(isinstance(i, dict) and i.get("type") == "function_call_output"
                                           for i in items)


class Script:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir

    # --- Messages API (Claude Code) -------------------------------------------------------
    def message_blocks(self, body: dict) -> tuple[list[dict], str]:
        if body.get("tools") and not _has_tool_result_messages(body):
            calls = [("Read", {"file_path": str(self.workdir / "notes.txt")}),
                     ("Read", {"file_path": str(self.workdir / "missing.txt")})]
            return [{"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:20]}", "name": name, "input": args}
                    for name, args in calls], "tool_use"
        blocks: list[dict] = []
        if body.get("tools"):
            blocks.append({"type": "thinking", "thinking": REASONING, "signature": "scripted"})
        blocks.append({"type": "text", "text": ANSWER if body.get("tools") else "Notes summary"})
        return blocks, "end_turn"

    def message_events(self, body: dict) -> Iterator[bytes]:
        blocks, stop = self.message_blocks(body)
        usage = {"input_tokens": 10, "output_tokens": 0}
        yield _sse("message_start", {"type": "message_start", "message": {
            "id": f"msg_{uuid.uuid4().hex[:20]}", "type": "message", "role": "assistant", "model": body.get("model"),
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}})
        for i, block in enumerate(blocks):
            if block["type"] == "tool_use":
                yield _sse("content_block_start", {"type": "content_block_start", "index": i,
                                                   "content_block": {**block, "input": {}}})
                delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            elif block["type"] == "thinking":
                yield _sse("content_block_start", {"type": "content_block_start", "index": i,
                                                   "content_block": {"type": "thinking", "thinking": "",
                                                                     "signature": ""}})
                yield _sse("content_block_delta", {"type": "content_block_delta", "index": i,
                                                   "delta": {"type": "thinking_delta", "thinking": block["thinking"]}})
                delta = {"type": "signature_delta", "signature": block["signature"]}
            else:
                yield _sse("content_block_start", {"type": "content_block_start", "index": i,
                                                   "content_block": {"type": "text", "text": ""}})
                delta = {"type": "text_delta", "text": block["text"]}
            yield _sse("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta})
            yield _sse("content_block_stop", {"type": "content_block_stop", "index": i})
        yield _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                                     "usage": {"output_tokens": 12}})
        yield _sse("message_stop", {"type": "message_stop"})

    # --- Responses API (Codex) --------------------------------------------------------------
    def response_items(self, body: dict) -> list[dict]:
        if body.get("tools") and not _has_tool_result_items(body):
            return [{"id": f"fc_{uuid.uuid4().hex[:16]}", "type": "function_call", "status": "completed",
                     "call_id": f"call_{uuid.uuid4().hex[:16]}", "name": "exec_command",
                     "arguments": json.dumps({"cmd": cmd})} for cmd in ("cat notes.txt", "cat missing.txt")]
        reasoning = {"id": f"rs_{uuid.uuid4().hex[:16]}", "type": "reasoning", "summary": [],
                     "encrypted_content": encode_reasoning(REASONING)}
        message = {"id": f"msg_{uuid.uuid4().hex[:16]}", "type": "message", "status": "completed",
                   "role": "assistant", "content": [{"type": "output_text", "text": ANSWER, "annotations": []}]}
        return [reasoning, message]

    def response_events(self, body: dict) -> Iterator[bytes]:
        rid = f"resp_{uuid.uuid4().hex[:16]}"
        base: dict[str, object] = {"id": rid, "object": "response", "model": body.get("model"), "output": []}
        seq = 0

        def ev(kind: str, **fields: object) -> bytes:
            nonlocal seq
            seq += 1
            return _sse(kind, {"type": kind, "sequence_number": seq, **fields})

        yield ev("response.created", response={**base, "status": "in_progress"})
        items = self.response_items(body)
        for index, item in enumerate(items):
            yield ev("response.output_item.added", output_index=index, item=item)
            yield ev("response.output_item.done", output_index=index, item=item)
        usage = {"input_tokens": 10, "output_tokens": 12, "total_tokens": 22,
                 "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
        yield ev("response.completed", response={**base, "status": "completed", "output": items, "usage": usage})


async def serve(port: int, workdir: Path) -> None:
    script = Script(workdir)

    async def messages(request: web.Request) -> web.StreamResponse:
        return await _stream(request, script.message_events(await request.json()))

    async def responses(request: web.Request) -> web.StreamResponse:
        return await _stream(request, script.response_events(await request.json()))

    app = application()
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/responses", responses)
    await serve_until_signal(app, port, f"scripted model on 127.0.0.1:{port}")


async def _stream(request: web.Request, events: Iterator[bytes]) -> web.StreamResponse:
    answer = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await answer.prepare(request)
    for chunk in events:
        await answer.write(chunk)
    await answer.write_eof()
    return answer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--workdir", type=Path, required=True)
    args = parser.parse_args(argv)
    asyncio.run(serve(args.port, args.workdir.resolve()))


if __name__ == "__main__":
    main()
