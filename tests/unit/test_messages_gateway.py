"""The Messages API's HTTP surface in-process, with the official `anthropic` client (over its own
HTTP library, httpx2, whose ASGI transport reaches the app without a socket): count_tokens
against a real gRPC processor servicer (in this process), the API key in `x-api-key`, and every
refusal in Anthropic's error shape, which the client raises as its own exception classes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anthropic
import grpc
import httpx2
import pytest

from gen.kvmesh.v1 import common_pb2, processor_pb2, processor_pb2_grpc
from services.frontend.app import create_app
from services.frontend.config import FrontendConfig
from services.frontend.lora_admin import LoraAdmin
from services.frontend.mesh import MeshView
from services.frontend.metrics import FrontendMetrics
from services.mesh.channels import ChannelPool
from services.mesh.grpc_server import abort_with
from services.mesh.session_kind import CallError
from tests.unit.in_process_grpc import serving
from tests.unit.test_lora_gateway import BASE, mesh_of, view, worker
from services.mesh.discovery import PROCESSOR, InstanceInfo

KEY = "sekrit"
HI = [{"role": "user", "content": "hi"}]


class CountingProcessor(processor_pb2_grpc.ProcessorServicer):
    """Answers CountTokens as a processor does: a count, or the refusal it ends a call with."""

    def __init__(self, refusal: CallError | None = None) -> None:
        self.refusal = refusal
        self.seen: list[processor_pb2.GenerateRequest] = []

    async def CountTokens(self, request: processor_pb2.GenerateRequest,  # noqa: N802
                          context: grpc.aio.ServicerContext) -> processor_pb2.CountTokensResponse:
        self.seen.append(request)
        if self.refusal is not None:
            await abort_with(context, self.refusal)
        return processor_pb2.CountTokensResponse(input_tokens=100 + len(request.chat.messages))


def processor_mesh(*addresses: str) -> MeshView:
    mesh = mesh_of(worker("w1"))
    mesh.processors = view(PROCESSOR, *(InstanceInfo(component=PROCESSOR, instance_id=f"p{i}", model=BASE,
                                                     address=address) for i, address in enumerate(addresses)))
    return mesh


@asynccontextmanager
async def client_of(mesh: MeshView, keys: tuple[str, ...] = (), key: str = KEY, hide: bool = False,
                    session_from_user: bool = False) -> AsyncIterator[anthropic.AsyncAnthropic]:
    channels = ChannelPool()
    config = FrontendConfig(api_keys=keys, hide_routing_details=hide, session_from_user=session_from_user)
    app = create_app(config, mesh, FrontendMetrics(), LoraAdmin(mesh, channels), channels)
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://gw") as http:
        yield anthropic.AsyncAnthropic(api_key=key, base_url="http://gw", http_client=http, max_retries=0)
    await channels.close()


async def test_count_tokens_asks_a_processor_to_count_the_rendered_chat_request() -> None:
    servicer = CountingProcessor()
    async with serving(processor_pb2_grpc.add_ProcessorServicer_to_server, servicer) as address, \
            client_of(processor_mesh(address), keys=(KEY,)) as client:
        counted = await client.messages.count_tokens(model=BASE, system="be brief", messages=HI)
    assert counted.input_tokens == 102  # the system and the user message
    [request] = servicer.seen
    assert request.model == BASE and [m.role for m in request.chat.messages] == ["system", "user"]


async def test_a_processors_refusal_is_the_answer_and_a_processor_gone_is_a_503() -> None:
    refusing = CountingProcessor(CallError(common_pb2.OUTCOME_CONTEXT_TOO_LONG, "the prompt has 9000 tokens",
                                           param="messages"))
    async with serving(processor_pb2_grpc.add_ProcessorServicer_to_server, refusing) as address, \
            client_of(processor_mesh(address)) as client:
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.messages.count_tokens(model=BASE, messages=HI)
    assert refused.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                             "message": "the prompt has 9000 tokens"}}
    # Nothing listens at either address: each is tried once, then the answer is a 503.
    async with client_of(processor_mesh("127.0.0.1:1", "127.0.0.1:2"), hide=True) as client:
        with pytest.raises(anthropic.ServiceUnavailableError) as gone:
            await client.messages.count_tokens(model=BASE, messages=HI)
    assert gone.value.body["error"]["type"] == "overloaded_error"
    assert "127.0.0.1" not in gone.value.body["error"]["message"]  # --hide-routing-details
    assert gone.value.response.headers["retry-after"] == "1"


async def test_the_key_may_come_as_x_api_key_or_bearer_and_a_wrong_one_is_an_authentication_error() -> None:
    servicer = CountingProcessor()
    async with serving(processor_pb2_grpc.add_ProcessorServicer_to_server, servicer) as address:
        mesh = processor_mesh(address)
        async with client_of(mesh, keys=(KEY,), key="wrong") as client:
            for call in (client.messages.create(model=BASE, max_tokens=4, messages=HI),
                         client.messages.count_tokens(model=BASE, messages=HI)):
                with pytest.raises(anthropic.AuthenticationError) as caught:
                    await call
                assert caught.value.body["error"]["type"] == "authentication_error"
            http = client._client
            bearer = await http.post("/v1/messages/count_tokens", json={"model": BASE, "messages": HI},
                                     headers={"authorization": f"Bearer {KEY}"})
            assert bearer.status_code == 200 and bearer.json() == {"input_tokens": 101}


async def test_every_refusal_is_in_anthropics_shape() -> None:
    mesh = mesh_of(worker("w1"))  # a decode worker knows the model; no processor serves it
    async with client_of(mesh) as client:
        with pytest.raises(anthropic.NotFoundError) as unknown:
            await client.messages.create(model="nope", max_tokens=4, messages=HI)
        assert unknown.value.body == {"type": "error", "error": {"type": "not_found_error",
                                                                 "message": "the model 'nope' does not exist"}}
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.count_tokens(model="nope", messages=HI)
        with pytest.raises(anthropic.BadRequestError) as image:
            await client.messages.create(model=BASE, max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}])
        assert image.value.body["error"]["message"].startswith("image URLs are not fetched from this address")
        with pytest.raises(anthropic.ServiceUnavailableError) as none:
            await client.messages.create(model=BASE, max_tokens=4, messages=HI, stream=True)
        assert none.value.body["error"]["type"] == "overloaded_error"
        http = client._client
        for reply in (await http.post("/v1/messages", content=b"{not json"),
                      await http.post("/v1/messages", content=b"[]"),
                      await http.get("/v1/messages")):
            body = reply.json()
            assert set(body) == {"type", "error"} and body["type"] == "error", body
            assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
        # The OpenAI endpoints keep OpenAI's shape.
        openai_shaped = await http.post("/v1/chat/completions", json={"model": "nope", "messages": HI})
        assert openai_shaped.status_code == 404 and openai_shaped.json()["error"]["code"] == "model_not_found"


async def test_a_user_id_that_cannot_name_a_session_is_refused_as_metadata_user_id() -> None:
    async with client_of(mesh_of(worker("w1")), session_from_user=True) as client:
        with pytest.raises(anthropic.BadRequestError) as caught:
            await client.messages.create(model=BASE, max_tokens=4, messages=HI, metadata={"user_id": "a/b"})
    assert caught.value.body["error"]["message"].startswith("metadata.user_id: must be"), caught.value.body


async def test_the_openapi_document_lists_the_messages_endpoints() -> None:
    async with client_of(mesh_of(worker("w1"))) as client:
        doc = (await client._client.get("/openapi.json")).json()
    for path, model in (("/v1/messages", "MessagesRequest"), ("/v1/messages/count_tokens", "CountTokensRequest")):
        post = doc["paths"][path]["post"]
        assert post["requestBody"]["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model}"}
        assert post["responses"]["404"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/AnthropicErrorBody"}
    assert {"model", "messages", "max_tokens"} <= set(doc["components"]["schemas"]["MessagesRequest"]["required"])
