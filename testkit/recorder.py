"""A recording reverse proxy: what a real client sends, and what the gateway answered, one JSON
line per exchange.

Agent CLIs (Claude Code, Codex) are the specification of what the gateway must take; the proxy
sits between them and the gateway so that a test (or a person capturing fixtures) sees every
request body and status, streamed answers included. Bodies are forwarded byte for byte and
streamed through chunk by chunk, so the client sees the gateway's timing.

    python -m testkit.recorder --upstream http://127.0.0.1:8000 --port 8100 --out exchanges.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from testkit.http_server import application, serve_until_signal

# Hop-by-hop headers a proxy must not pass on (RFC 9110 7.6.1), and those aiohttp sets itself.
_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "te",
                  "trailer", "host", "content-length", "content-encoding"})
# A streamed answer is kept up to this size in the record (the client gets all of it).
_KEEP_ANSWER = 1 << 20


def _decoded(raw: bytes) -> object:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw.decode("utf-8", "replace")


class Recorder:
    def __init__(self, upstream: str, out: Path) -> None:
        self.upstream = upstream.rstrip("/")
        self.out = out.open("a", encoding="utf-8")
        self.session: aiohttp.ClientSession | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        started = time.time()
        async with self.session.request(request.method, self.upstream + request.path_qs, headers=headers,
                                        data=body, allow_redirects=False, auto_decompress=True) as upstream:
            answer = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in _HOP})
            await answer.prepare(request)
            kept = bytearray()
            async for chunk in upstream.content.iter_any():
                if len(kept) < _KEEP_ANSWER:
                    kept += chunk[:_KEEP_ANSWER - len(kept)]
                await answer.write(chunk)
            await answer.write_eof()
        self._write({"t": started, "method": request.method, "path": request.path_qs,
                     "headers": {k.lower(): v for k, v in request.headers.items()
                                 if k.lower() not in ("authorization", "x-api-key")},
                     "body": _decoded(body), "status": upstream.status,
                     "content_type": upstream.headers.get("content-type", ""),
                     "answer": kept.decode("utf-8", "replace")})
        return answer

    def _write(self, record: dict) -> None:
        self.out.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.out.flush()


async def serve(upstream: str, port: int, out: Path) -> None:
    recorder = Recorder(upstream, out)
    # No total deadline: a streamed answer lasts as long as the gateway streams it.
    recorder.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                             auto_decompress=False)
    app = application()
    app.router.add_route("*", "/{tail:.*}", recorder.handle)
    await serve_until_signal(app, port, f"recorder on 127.0.0.1:{port} -> {upstream}")
    await recorder.session.close()
    recorder.out.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    asyncio.run(serve(args.upstream, args.port, args.out))


if __name__ == "__main__":
    main()
