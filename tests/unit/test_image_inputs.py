"""Image inputs at the gateway (frontend/images.py) and in the processor (processor/images.py):
data URLs decoded within the limits, URLs fetched only from allowed prefixes, every refusal a 400
naming the part; images opened and widened into the model's placeholder tokens."""

from __future__ import annotations

import asyncio
import base64
import io

import pytest
from PIL import Image

from services.config_error import ConfigError
from services.frontend.errors import ApiError
from services.frontend.images import ImageLimits, ImageLoader, ImageRef
from services.kv_protocol.media import media_digest
from services.processor.chat_render import ChatPrompt
from services.processor.images import open_image
from services.processor.prompt_errors import PromptError


def png(width: int = 40, height: int = 30, shade: int = 0) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (shade, 100, 200)).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def load(limits: ImageLimits, *urls: str) -> dict:
    return asyncio.run(ImageLoader(limits).load([ImageRef((0, j), url) for j, url in enumerate(urls)]))


def refusal(limits: ImageLimits, *urls: str) -> ApiError:
    with pytest.raises(ApiError) as refused:
        load(limits, *urls)
    assert refused.value.status == 400
    return refused.value


def test_a_data_url_is_decoded() -> None:
    assert load(ImageLimits(), data_url(png())) == {(0, 0): png()}


@pytest.mark.parametrize(("url", "code"), [
    ("data:image/png;base64,@@@@", "invalid_image"),
    ("data:text/plain;base64,aGk=", "invalid_image"),
    ("data:image/png,rawbytes", "invalid_image"),
    ("data:image/png;base64,", "invalid_image"),
    ("file:///etc/passwd", "invalid_image"),
    ("http://169.254.169.254/latest/meta-data", "image_url_not_allowed"),
])
def test_bad_image_urls_are_refused_naming_the_part(url: str, code: str) -> None:
    refused = refusal(ImageLimits(), data_url(png()), url)
    assert (refused.code, refused.param) == (code, "messages.0.content.1")


def test_limits_on_size_and_count() -> None:
    big = refusal(ImageLimits(max_image_bytes=100), data_url(png(200, 200, 7)))
    assert big.code == "image_too_large"
    many = refusal(ImageLimits(max_images=2), *[data_url(png())] * 3)
    assert (many.code, many.param) == ("too_many_images", "messages.0.content.2")


@pytest.mark.parametrize("url", ["https://images.example.com.evil.test/x.png",
                                 "https://images.example.com@evil.test/x.png",
                                 "https://images.example.com/public/../private/x.png",
                                 "https://images.example.com/public/%2e%2e/private/x.png",
                                 "http://images.example.com/public/x.png"])
def test_a_url_outside_the_allowed_prefixes_is_not_fetched(url: str) -> None:
    limits = ImageLimits(url_allow=("https://images.example.com/public/",))
    assert refusal(limits, url).code == "image_url_not_allowed"


def test_an_allowed_url_is_compared_as_it_will_be_requested() -> None:
    loader = ImageLoader(ImageLimits(url_allow=("HTTPS://Images.Example.com:443/public/",)))
    assert str(loader._allowed(ImageRef((0, 0), "https://images.example.com/public/a/../x.png"))) == \
        "https://images.example.com/public/x.png"


def test_a_malformed_url_is_a_400() -> None:
    assert refusal(ImageLimits(url_allow=("https://a.example/",)), "https://a.example/\x00" + "x" * 70_000).code in (
        "invalid_image", "image_url_not_allowed")


def test_the_request_s_images_are_bounded_in_all() -> None:
    big = bytes(range(256)) * 400  # 100 kB
    refused = refusal(ImageLimits(max_request_image_bytes=250_000), *[data_url(big)] * 3)
    assert (refused.code, refused.param) == ("image_too_large", "messages.0.content.2")


@pytest.mark.parametrize("prefix", ["https://images.example.com", "ftp://x/", "images.example.com/"])
def test_an_allowed_prefix_must_end_its_host(prefix: str) -> None:
    with pytest.raises(ConfigError, match="--image-url-allow"):
        ImageLimits(url_allow=(prefix,))


def test_the_processor_opens_images_and_names_them_by_their_bytes() -> None:
    image = open_image(png(64, 48), "messages.0.content.0")
    assert (image.media_type, image.width, image.height, image.digest) == ("image/png", 64, 48, media_digest(png(64, 48)))


def damaged() -> bytes:
    data = bytearray(png())
    data[-20] ^= 0xFF  # inside the last data chunk: its checksum no longer holds
    return bytes(data)


def cut_jpeg() -> bytes:
    out = io.BytesIO()
    Image.effect_noise((64, 64), 40).convert("RGB").save(out, "JPEG")
    return out.getvalue()[: len(out.getvalue()) // 2]  # its header intact, its pixels half gone


@pytest.mark.parametrize(("data", "says"), [
    (b"not an image at all", "not a PNG, JPEG, GIF or WebP"),
    (damaged(), "cannot be read"),
    (cut_jpeg(), "cannot be read"),
])
def test_what_is_not_an_image_is_refused(data: bytes, says: str) -> None:
    with pytest.raises(PromptError, match=says) as refused:
        open_image(data, "messages.2.content.1")
    assert refused.value.param == "messages.2.content.1"


def test_an_image_decoded_before_is_not_decoded_again_and_its_header_still_checked() -> None:
    asked: list[int] = []

    def decoded(digest: int) -> bool:
        asked.append(digest)
        return True

    data = cut_jpeg()  # a whole decode would refuse it: skipped, the image is taken as decoded before
    assert open_image(data, "p", decoded).digest == media_digest(data) == asked[0]
    with pytest.raises(PromptError, match="cannot be read"):
        open_image(data, "p", lambda digest: False)
    with pytest.raises(PromptError, match="not a PNG"):
        open_image(b"not an image at all", "p", decoded)


def test_a_bmp_is_refused_by_format() -> None:
    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, "BMP")
    with pytest.raises(PromptError, match="format BMP"):
        open_image(out.getvalue(), "p")


@pytest.fixture(scope="module")
def vlm_tokenizer():  # noqa: ANN201
    from services.processor.tokenizer import ModelTokenizer

    return ModelTokenizer(".cache/models/kvmesh-demo-vlm")


def prompt(*images: bytes) -> ChatPrompt:
    parts = [{"type": "text", "text": "what is on screen?"}, *({"type": "image"} for _ in images)]
    return ChatPrompt([{"role": "user", "content": parts}], images=tuple(open_image(i, "p") for i in images))


def test_each_image_token_is_widened_as_the_model_s_processor_does(vlm_tokenizer) -> None:  # noqa: ANN001
    ids, media = vlm_tokenizer.encode_chat_media(prompt(png(), png(300, 200, 9)))
    image_token = vlm_tokenizer.facts.vision.image_token_id
    assert [(m.width, m.height) for m in media] == [(40, 30), (300, 200)]
    for item in media:
        span = ids[item.span.offset:item.span.offset + item.span.length]
        assert span.count(image_token) == 16  # the demo VLM: 16 image tokens an image, whatever its size
        assert item.span.digest == media_digest(item.data)
    assert media[0].span.offset + media[0].span.length <= media[1].span.offset
    assert ids.count(image_token) == 32


def test_a_text_model_refuses_images() -> None:
    from services.processor.tokenizer import ModelTokenizer

    with pytest.raises(PromptError, match="takes text only"):
        ModelTokenizer(".cache/models/kvmesh-demo").encode_chat_media(prompt(png()))
