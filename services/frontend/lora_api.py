"""The gateway's LoRA endpoints (vLLM's shapes) and the model list's entries.

- `POST /v1/load_lora_adapter` `{"lora_name", "lora_path"[, "base_model_name"]}`: loads the adapter
  on the base model's workers; 200 with a plain-text line ("Success: LoRA adapter 'NAME' added
  successfully.").
- `POST /v1/unload_lora_adapter` `{"lora_name"}`: 200 "Success: LoRA adapter 'NAME' removed
  successfully.".

Errors are the API's JSON error body; the status of each outcome is `_STATUS` (lora_admin.py
says which outcome a load or unload ends with): 400 for a missing or invalid field, an adapter
the workers cannot use (invalid_adapter), a name loaded from another path (adapter_conflict) or
no worker serving LoRA (lora_disabled); 404 for unloading an adapter no worker knows
(unknown_adapter) and for a base_model_name the mesh does not serve; 503 when the workers did not
answer. Both endpoints take the gateway's API key like every other.

`/v1/models` lists each base model and each adapter of one (`model_cards`), in the shape vLLM
gives them: an adapter's `parent` is its base model and its `root` the path it was loaded from
(when this gateway loaded it; the workers' records name adapters, not paths). Each card's
`max_model_len` is the context length its (base) model is served with: the smallest its decode
workers publish (services/contract/served_context.py), the limit the processors enforce.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from fastapi import FastAPI, Request
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse, PlainTextResponse, Response

from services.contract.served_context import served_context
from services.frontend import openapi
from services.frontend.agent_schemas import valid_unicode
from services.frontend.auth import check_api_key, presented_key
from services.frontend.body import read_json
from services.frontend.errors import ApiError
from services.frontend.lora_admin import LoraAdmin, LoraOutcome, LoraResult
from services.frontend.mesh import MeshView, ModelTarget

# The longest adapter name taken: it becomes a model name, a record entry and a metric label.
MAX_LORA_NAME_CHARS = 256
MAX_LORA_PATH_CHARS = 4096


def _printable(value: str) -> str:
    if not value.isprintable():
        raise ValueError("must be printable text (no control characters or line breaks)")
    return value


LoraName = Annotated[str, Field(min_length=1, max_length=MAX_LORA_NAME_CHARS), AfterValidator(valid_unicode),
                     AfterValidator(_printable)]


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: LoraName
    # A PEFT adapter directory on the workers' file system.
    lora_path: Annotated[str, Field(min_length=1, max_length=MAX_LORA_PATH_CHARS), AfterValidator(valid_unicode)]
    # Which served model it adapts; may be left out where the mesh serves one.
    base_model_name: str | None = None
    # vLLM's: replace an adapter of the same name. Not supported (unload it first).
    load_inplace: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: LoraName
    # vLLM accepts an int id beside the name; the mesh names adapters only.
    lora_int_id: int | None = None


_Body = TypeVar("_Body", LoadLoraAdapterRequest, UnloadLoraAdapterRequest)

# (status, param) per outcome of a load or an unload.
_STATUS: dict[LoraOutcome, tuple[int, str | None]] = {
    LoraOutcome.LOADED: (200, None),
    LoraOutcome.REMOVED: (200, None),
    LoraOutcome.INVALID: (400, "lora_path"),
    LoraOutcome.CONFLICT: (400, "lora_name"),
    LoraOutcome.LORA_OFF: (400, None),
    LoraOutcome.UNKNOWN: (404, "lora_name"),
    LoraOutcome.UNREACHABLE: (503, None),
}


_ERROR_DESCRIPTIONS = {
    400: "a missing or invalid field, an adapter the workers cannot use, a name loaded from another path, "
         "or no worker serving LoRA",
    401: "missing or wrong API key",
    404: "an adapter no worker knows (unload), a base_model_name not served (load)",
    413: "body over the limit",
    503: "the workers did not answer; retry after Retry-After seconds",
}


def answer(result: LoraResult) -> Response:
    """The HTTP answer to a load's or an unload's result (`_STATUS`)."""
    status, param = _STATUS[result.outcome]
    if status == 200:
        return PlainTextResponse(result.message)
    code = "unavailable" if result.outcome is LoraOutcome.UNREACHABLE else result.outcome.value
    return ApiError(status, result.message, param=param, code=code).response()


def model_cards(mesh: MeshView, paths: dict[str, str]) -> list[dict[str, object]]:
    """`/v1/models`' entries: the base models, then their adapters, by name."""
    decoders = list(mesh.decoders.instances.values())
    served = {model: served_context(decoders, model) for model in mesh.models()}
    cards = [_card(model, root=model, parent=None, max_model_len=served[model]) for model in served]
    cards += [_card(name, root=paths.get(name), parent=base, max_model_len=served.get(base))
              for name, base in sorted(mesh.adapters().items())]
    return cards


def _card(model: str, root: str | None, parent: str | None, max_model_len: int | None) -> dict[str, object]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "kvmesh", "root": root, "parent": parent,
            "max_model_len": max_model_len}


def check_runtime_lora(allowed: bool) -> None:
    """The load and unload endpoints read paths on the workers' machines and change what every
    client is served: off unless the gateway was started with --allow-runtime-lora (vLLM keeps
    them behind VLLM_ALLOW_RUNTIME_LORA_UPDATING alike)."""
    if not allowed:
        raise ApiError(403, "loading and unloading LoRA adapters at run time is off: start the gateway with "
                            "--allow-runtime-lora", code="runtime_lora_disabled")


def add_lora_routes(app: FastAPI, mesh: MeshView, admin: LoraAdmin, api_keys: tuple[str, ...],
                    max_body_bytes: int, allow_runtime: bool = False) -> None:
    responses: dict[int | str, dict[str, Any]] = {
        200: {"description": "the adapter was loaded (or removed): one line of text",
              "content": {"text/plain": {"schema": {"type": "string"}}}},
        # Errors are JSON though the success is text: the body's schema is given, not its model.
        **{status: {"description": why,
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}}
           for status, why in _ERROR_DESCRIPTIONS.items()}}

    @app.post("/v1/load_lora_adapter", openapi_extra=openapi.request_body(LoadLoraAdapterRequest),
              responses=responses, response_class=PlainTextResponse)
    async def load_lora_adapter(request: Request) -> Response:
        """Loads a LoRA adapter on the workers of its base model (vLLM's endpoint)."""
        try:
            check_api_key(presented_key(request.headers), api_keys)
            check_runtime_lora(allow_runtime)
            req = _parse(LoadLoraAdapterRequest, await read_json(request, max_body_bytes))
            if req.load_inplace:
                raise ApiError(400, "load_inplace is not supported: unload the adapter first", param="load_inplace",
                               code="unsupported_parameter")
            if mesh.knows_model(req.lora_name):
                raise ApiError(400, f"lora_name {req.lora_name!r} is the name of a base model", param="lora_name",
                               code="invalid_value")
            target = ModelTarget(_base_model(mesh, req.base_model_name), req.lora_name)
            return answer(await admin.load(target, req.lora_path))
        except ApiError as exc:
            return exc.response()

    @app.post("/v1/unload_lora_adapter", openapi_extra=openapi.request_body(UnloadLoraAdapterRequest),
              responses=responses, response_class=PlainTextResponse)
    async def unload_lora_adapter(request: Request) -> Response:
        """Unloads a LoRA adapter from every worker that knows it (vLLM's endpoint)."""
        try:
            check_api_key(presented_key(request.headers), api_keys)
            check_runtime_lora(allow_runtime)
            req = _parse(UnloadLoraAdapterRequest, await read_json(request, max_body_bytes))
            return answer(await admin.unload(req.lora_name))
        except ApiError as exc:
            return exc.response()

    @app.get("/v1/models", responses={401: openapi.ERROR_RESPONSES[401]})
    async def models(request: Request) -> JSONResponse:
        """The served base models and their LoRA adapters (each with its `parent`)."""
        try:
            check_api_key(presented_key(request.headers), api_keys)
        except ApiError as exc:
            return exc.response()
        return JSONResponse({"object": "list", "data": model_cards(mesh, admin.paths)})


def _base_model(mesh: MeshView, named: str | None) -> str:
    """The base model a load is for: the one named, or the mesh's only one."""
    served = mesh.models()
    if named is not None:
        if named not in served:
            raise ApiError(404, f"the model {named[:200]!r} does not exist", param="base_model_name",
                           code="model_not_found")
        return named
    if len(served) == 1:
        return served[0]
    if not served:
        _, reason = mesh.health()
        raise ApiError(503, f"no base model is served ({reason})", code="unavailable")
    raise ApiError(400, f"the mesh serves several base models ({', '.join(served)}): name one in base_model_name",
                   param="base_model_name", code="invalid_value")


def _parse(schema: type[_Body], body: object) -> _Body:
    """The validated body, or a 400 naming the missing fields or the first invalid one."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        missing = [str(e["loc"][0]) for e in errors if e["type"] == "missing"]
        if missing:
            raise ApiError(400, f"missing required field{'s' if len(missing) > 1 else ''}: {', '.join(missing)}",
                           param=missing[0], code="missing_field") from None
        first = errors[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise ApiError(400, f"invalid field {param}: {first['msg']}", param=param, code="invalid_value") from None
