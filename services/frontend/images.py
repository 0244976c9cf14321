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

import asyncio
import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from services.config_error import ConfigError
from services.frontend.errors import ApiError

# The `param` of an image part: its message index and part index.
PartKey = tuple[int, int]
# One image's fetch, start to end (a server that sends a byte now and then is cut off too).
FETCH_DEADLINE_S = 10.0


@dataclass(frozen=True)
class ImageLimits:
    # Images in one request (all its messages), the bytes of each once decoded, and of all of
    # them: a request travels whole in one message on each hop (the TCP carrier takes frames of
    # up to 64 MiB, gRPC messages as large), and a choice's worker call carries them again.
    max_images: int = 32
    max_image_bytes: int = 10 * 1024 * 1024
    max_request_image_bytes: int = 32 * 1024 * 1024
    # URL prefixes an `http(s)` image may be fetched from (none: only data URLs are taken).
    url_allow: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_images < 0:
            raise ConfigError(f"--max-images must be >= 0, got {self.max_images}")
        if self.max_image_bytes <= 0:
            raise ConfigError(f"--max-image-bytes must be > 0, got {self.max_image_bytes}")
        if not 0 < self.max_request_image_bytes <= 48 * 1024 * 1024:
            raise ConfigError(f"--max-request-image-bytes must be within 1..{48 * 1024 * 1024} (a request travels in "
                              f"one message of at most 64 MiB), got {self.max_request_image_bytes}")
        for prefix in self.url_allow:
            scheme, sep, rest = prefix.partition("://")
            # A bare host would also allow `https://host.evil.example/`: the prefix must end its host.
            if scheme.lower() not in ("http", "https") or not sep or "/" not in rest:
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
        # The allowed prefixes normalised as request URLs are (`HTTPS://Host:443/` is `https://host/`).
        self._prefixes = tuple(_normal(httpx.URL(prefix)) for prefix in limits.url_allow)

    async def load(self, refs: Sequence[ImageRef]) -> dict[PartKey, bytes]:
        if len(refs) > self.limits.max_images:
            raise ApiError(400, f"the request has {len(refs)} images; at most {self.limits.max_images} are taken",
                           param=refs[self.limits.max_images].param, code="too_many_images")
        out: dict[PartKey, bytes] = {}
        total = 0
        for ref in refs:
            data = self._decoded(ref) if ref.url.startswith("data:") else await self._fetched(ref)
            total += len(data)
            if total > self.limits.max_request_image_bytes:
                raise ApiError(400, f"the request's images hold more than {self.limits.max_request_image_bytes} "
                                    f"bytes in all", param=ref.param, code="image_too_large")
            out[ref.key] = data
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
        url = self._allowed(ref)
        try:
            # No proxy or credentials from the environment: the address checked is the one reached.
            async with asyncio.timeout(FETCH_DEADLINE_S), \
                    httpx.AsyncClient(timeout=FETCH_DEADLINE_S, follow_redirects=False, trust_env=False) as client, \
                    client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise ApiError(400, f"fetching the image answered HTTP {response.status_code}", param=ref.param,
                                   code="image_fetch_failed")
                data = bytearray()
                async for chunk in response.aiter_bytes():
                    data += chunk
                    if len(data) > self.limits.max_image_bytes:
                        raise self._too_large(ref)
        except (httpx.HTTPError, TimeoutError) as exc:
            raise ApiError(400, f"the image could not be fetched within {FETCH_DEADLINE_S:g}s: {type(exc).__name__}",
                           param=ref.param, code="image_fetch_failed") from None
        return bytes(data)

    def _allowed(self, ref: ImageRef) -> httpx.URL:
        """The URL to fetch, normalised as it will be requested (`a/../b` is `b`), once it is under
        an allowed prefix; a 400 otherwise."""
        try:
            url = httpx.URL(ref.url)
        except (httpx.InvalidURL, ValueError):
            url = None
        if url is None or url.scheme not in ("http", "https") or not url.host:
            raise ApiError(400, "an image URL must be a data: URL (or an http(s) URL the operator allowed)",
                           param=ref.param, code="invalid_image")
        # Dot segments the server would resolve (%2e%2e reaches the path decoded) and credentials
        # have no place in an image's address.
        odd = url.userinfo or any(segment in (".", "..") for segment in url.path.split("/"))
        normal = _normal(url)
        if odd or not any(normal.startswith(prefix) for prefix in self._prefixes):
            raise ApiError(400, "image URLs are not fetched from this address: send the image as a data: URL "
                                "(the operator allows URLs with --image-url-allow)", param=ref.param,
                           code="image_url_not_allowed")
        return url

    def _too_large(self, ref: ImageRef) -> ApiError:
        return ApiError(400, f"the image is larger than {self.limits.max_image_bytes} bytes", param=ref.param,
                        code="image_too_large")


def _normal(url: httpx.URL) -> str:
    """A URL as prefixes are compared: scheme and host in lower case, no default port, the path
    with its dot segments resolved and its escapes decoded."""
    default = {"http": 80, "https": 443}.get(url.scheme)
    port = f":{url.port}" if url.port and url.port != default else ""
    return f"{url.scheme}://{url.host}{port}{url.path}"
