"""vLLM's encode stage's directory (services/engines/vllm_encode.py), in-process: a consumer asks
for the images with no features there, each once; it takes features only from a file that is
there; the producer's directory stays bounded, the oldest images going first."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.engines.base import EngineRequest, MediaInput, Sampling
from services.engines.vllm_encode import FEATURES_FILE, EncoderCacheShare, prune
from services.kv_protocol.media import MediaSpan, media_digest, media_uuid


def image(name: bytes, offset: int = 0) -> MediaInput:
    return MediaInput(MediaSpan(media_digest(name), offset, 18), name, "image/png", 8, 8)


def stored(directory: Path, item: MediaInput, mtime: float | None = None) -> Path:
    path = directory / media_uuid(item.span.digest) / FEATURES_FILE
    path.parent.mkdir(parents=True)
    path.write_bytes(b"features")
    if mtime is not None:
        os.utime(path.parent, (mtime, mtime))
    return path


def test_a_consumer_asks_for_images_with_no_features_there_each_once(tmp_path: Path) -> None:
    share = EncoderCacheShare(str(tmp_path), producer=False)
    a, b = image(b"a"), image(b"b", 20)
    stored(tmp_path, a)
    twice = EngineRequest("r", list(range(60)), Sampling(), media=(a, b, image(b"b", 40)))
    assert share.to_encode(twice) == [b]
    assert EncoderCacheShare(str(tmp_path), producer=True).to_encode(twice) == []  # a producer takes nothing
    assert share.transfer_config()["ec_role"] == "ec_consumer"


def test_features_are_taken_only_from_a_file_that_is_there(tmp_path: Path) -> None:
    share = EncoderCacheShare(str(tmp_path), producer=False)
    a = image(b"a")
    path = stored(tmp_path, a)
    share.taken(a, {"file": str(path)})
    with pytest.raises(FileNotFoundError, match="share"):
        share.taken(a, {"file": str(tmp_path / "elsewhere" / FEATURES_FILE)})


def test_the_directory_keeps_the_newest_images(tmp_path: Path) -> None:
    items = [image(bytes([i])) for i in range(6)]
    for age, item in enumerate(items):
        stored(tmp_path, item, mtime=1_000_000 + age)
    assert prune(str(tmp_path), keep=4) == 2
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {media_uuid(item.span.digest) for item in items[2:]}
    assert prune(str(tmp_path / "none"), keep=4) == 0
