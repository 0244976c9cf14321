"""The generation endpoints' fast path (services/frontend/fast_paths.py), in-process over ASGI:
a POST to a fast path reaches its handler without the app; anything else reaches the app; an
exception the handler did not expect is a 500 in the OpenAI error shape, never a broken response."""

from __future__ import annotations

import httpx
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from services.frontend.fast_paths import FastPaths


def make() -> FastPaths:
    app = FastAPI()

    @app.get("/v1/completions")
    async def via_app() -> JSONResponse:
        return JSONResponse({"via": "app"})

    async def answer(request: Request) -> Response:
        return JSONResponse({"via": "fast path", "body": await request.json()})

    async def broken(request: Request) -> Response:
        raise RuntimeError("a bug")

    return FastPaths(app, {"/v1/completions": answer, "/v1/broken": broken})


async def test_a_post_takes_the_fast_path_and_other_methods_the_app() -> None:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=make()), base_url="http://t") as client:
        fast = await client.post("/v1/completions", json={"prompt": "x"})
        slow = await client.get("/v1/completions")
        missing = await client.post("/v1/other", json={})
    assert fast.json() == {"via": "fast path", "body": {"prompt": "x"}}
    assert slow.json() == {"via": "app"}
    assert missing.status_code == 404


async def test_an_unexpected_exception_is_a_500_in_the_openai_shape() -> None:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=make()), base_url="http://t") as client:
        r = await client.post("/v1/broken", json={})
    assert r.status_code == 500
    assert r.json()["error"] == {"message": "internal error", "type": "server_error", "param": None,
                                 "code": "internal_error"}
