"""The OpenAPI document's request bodies, taken from the pydantic models that validate them.

The POST handlers read the raw body themselves (size limit, strict JSON, errors in the OpenAI
shape), so FastAPI sees no body parameter to describe; each route gets its body schema from
`request_body`, and the models' shared definitions are hoisted into `components.schemas`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from services.frontend.errors import AnthropicErrorBody, ErrorBody

_REF = "#/components/schemas/{model}"

# The statuses a POST endpoint answers with the error body (see errors.py).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": why}
    for status, why in ((400, "malformed JSON, an invalid field, a prompt longer than the context"),
                        (401, "missing or wrong API key"), (404, "unknown model"), (413, "body over the limit"),
                        (429, "overloaded; retry after Retry-After seconds"),
                        (503, "no worker available; retry after Retry-After seconds"))
}


# The same statuses on the Messages API, with Anthropic's error body (errors.py).
ANTHROPIC_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": AnthropicErrorBody, "description": answer["description"]} for status, answer in ERROR_RESPONSES.items()
}


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body `model` validates."""
    schema = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"content": {"application/json": {"schema": schema}}, "required": True}}


def install(app: FastAPI, models: Sequence[type[BaseModel]]) -> None:
    """Makes `app.openapi()` include the models (and what they reference) in its components."""
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    schemas = defs.get("$defs", {})

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            document.setdefault("components", {}).setdefault("schemas", {}).update(schemas)
            app.openapi_schema = document
        return app.openapi_schema

    replace: Callable[[], dict[str, Any]] = openapi
    app.openapi = replace  # type: ignore[method-assign]
