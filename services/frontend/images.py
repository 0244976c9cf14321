"""A request's images, from what the client sent to the bytes the processor gets.

All three APIs reach the chat path with OpenAI's `image_url` parts (messages_api.py and
responses_input.py translate Anthropic's `image` blocks and the Responses API's `input_image`),
so this is the one place images are read:
- a `data:` URL (what every agent sends: a pasted screenshot, a page it rendered) is decoded here;
- an `http(s)` URL is fetched here, and only when it starts with one of the operator's allowed
  prefixes (--image-url-allow): no process of the mesh fetches an address a client chose, since
  it would reach whatever the mesh's network reaches;
- the count per request and the size of each image are bounded, each refusal a 400 naming the part.
Whether the bytes are an image the model can take is the processor's to say (it opens them).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from services.config_error import ConfigError
from services.frontend.errors import ApiError

# The `param` of an image part: its message index and part index.
PartKey = tuple[int, int]
_FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ImageLimits:
    # Images in one request (all its messages), and the bytes of each once decoded.
    max_images: int = 32
    max_image_bytes: int = 10 * 1024 * 1024
    # URL prefixes an `http(s)` image may be fetched from (none: only data URLs are taken).
    url_allow: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_images < 0:
            raise ConfigError(f"--max-images must be >= 0, got {self.max_images}")
        if self.max_image_bytes <= 0:
            raise ConfigError(f"--max-image-bytes must be > 0, got {self.max_image_bytes}")
        for prefix in self.url_allow:
            scheme, sep, rest = prefix.partition("://")
            # A bare host would also allow `https://host.evil.example/`: the prefix must end its host.
            if scheme not in ("http", "https") or not sep or "/" not in rest:
                raise ConfigError(f"--image-url-allow {prefix!r}: give an http(s) URL prefix whose host ends with "
                                  f"a slash, e.g. https://images.example.com/")


@dataclass(frozen=True)
class ImageRef:
    """One image part as the client wrote it."""

    key: PartKey
    url: str

    @property
    def param(self) -> str:
        return f"messages.{self.key[0]}.content.{self.key[1]}"


class ImageLoader:
    """Turns a request's image parts into bytes, within the limits."""

    def __init__(self, limits: ImageLimits) -> None:
        self.limits = limits

    async def load(self, refs: Sequence[ImageRef]) -> dict[PartKey, bytes]:
        if len(refs) > self.limits.max_images:
            raise ApiError(400, f"the request has {len(refs)} images; at most {self.limits.max_images} are taken",
                           param=refs[self.limits.max_images].param, code="too_many_images")
        out: dict[PartKey, bytes] = {}
        for ref in refs:
            if ref.url.startswith("data:"):
                out[ref.key] = self._decoded(ref)
            else:
                out[ref.key] = await self._fetched(ref)
        return out

    def _decoded(self, ref: ImageRef) -> bytes:
        header, comma, payload = ref.url.partition(",")
        media_type = header[5:].split(";")[0].strip().lower()
        if not comma or not header.endswith(";base64"):
            raise ApiError(400, "an image data URL must be base64: data:image/<type>;base64,<data>", param=ref.param,
                           code="invalid_image")
        if not media_type.startswith("image/"):
            raise ApiError(400, f"a data URL of type {media_type[:60]!r} is not an image", param=ref.param,
                           code="invalid_image")
        # base64 takes 4 characters per 3 bytes: a payload this long cannot fit, so it is not decoded.
        if len(payload) > (self.limits.max_image_bytes + 2) // 3 * 4 + 4:
            raise self._too_large(ref)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, "the image data URL is not valid base64", param=ref.param,
                           code="invalid_image") from None
        if len(data) > self.limits.max_image_bytes:
            raise self._too_large(ref)
        if not data:
            raise ApiError(400, "the image is empty", param=ref.param, code="invalid_image")
        return data

    async def _fetched(self, ref: ImageRef) -> bytes:
        if not ref.url.startswith(("http://", "https://")):
            raise ApiError(400, "an image URL must be a data: URL (or an http(s) URL the operator allowed)",
                           param=ref.param, code="invalid_image")
        if not any(ref.url.startswith(prefix) for prefix in self.limits.url_allow):
            raise ApiError(400, "image URLs are not fetched from this address: send the image as a data: URL "
                                "(the operator allows URLs with --image-url-allow)", param=ref.param,
                           code="image_url_not_allowed")
        try:
            async with httpx.AsyncClient(timeout=_FETCH_TIMEOUT_S, follow_redirects=False) as client, \
                    client.stream("GET", ref.url) as response:
                if response.status_code != 200:
                    raise ApiError(400, f"fetching the image answered HTTP {response.status_code}", param=ref.param,
                                   code="image_fetch_failed")
                data = bytearray()
                async for chunk in response.aiter_bytes():
                    data += chunk
                    if len(data) > self.limits.max_image_bytes:
                        raise self._too_large(ref)
        except httpx.HTTPError as exc:
            raise ApiError(400, f"the image could not be fetched: {type(exc).__name__}", param=ref.param,
                           code="image_fetch_failed") from None
        return bytes(data)

    def _too_large(self, ref: ImageRef) -> ApiError:
        return ApiError(400, f"the image is larger than {self.limits.max_image_bytes} bytes", param=ref.param,
                        code="image_too_large")
