"""Blocks that hold an image's tokens hash with the image: the same ids with another image never
match, the same image always does, and a block hashed alone mid-sequence hashes as in the whole."""

from __future__ import annotations

from services.kv_protocol.hashing import block_hash_with_media, local_block_hashes
from services.kv_protocol.media import MediaSpan, media_digest

TOKENS = list(range(100, 196))  # six blocks of 16
A, B = media_digest(b"screenshot A"), media_digest(b"screenshot B")


def test_only_the_blocks_that_hold_the_image_change() -> None:
    plain = local_block_hashes(TOKENS, 16)
    with_image = local_block_hashes(TOKENS, 16, media=[MediaSpan(A, 20, 20)])  # tokens 20..39: blocks 1 and 2
    assert [p != m for p, m in zip(plain, with_image, strict=True)] == [False, True, True, False, False, False]


def test_another_image_with_the_same_ids_never_matches() -> None:
    a = local_block_hashes(TOKENS, 16, media=[MediaSpan(A, 20, 20)])
    b = local_block_hashes(TOKENS, 16, media=[MediaSpan(B, 20, 20)])
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2] and a[3:] == b[3:]


def test_the_same_image_elsewhere_in_a_block_hashes_apart() -> None:
    # Same ids, same image, one token later: the block's KV differs, so must its hash.
    assert (local_block_hashes(TOKENS, 16, media=[MediaSpan(A, 20, 10)])[1]
            != local_block_hashes(TOKENS, 16, media=[MediaSpan(A, 21, 10)])[1])


def test_the_same_image_hashes_the_same_each_time() -> None:
    span = [MediaSpan(media_digest(b"screenshot A"), 20, 20)]
    assert local_block_hashes(TOKENS, 16, media=span) == local_block_hashes(TOKENS, 16, media=list(span))


def test_a_block_hashed_alone_mid_sequence_hashes_as_in_the_whole() -> None:
    # The mocker hashes a block when decode fills it: `start` places it in the prompt.
    media = [MediaSpan(A, 20, 20), MediaSpan(B, 60, 40)]
    whole = local_block_hashes(TOKENS, 16, media=media)
    for b in range(6):
        alone = local_block_hashes(TOKENS[b * 16:(b + 1) * 16], 16, media=media, start=b * 16)
        assert alone == [whole[b]], b


def test_an_image_past_the_last_full_block_changes_nothing_hashed() -> None:
    assert local_block_hashes(TOKENS[:90], 16, media=[MediaSpan(A, 85, 5)]) == local_block_hashes(TOKENS[:90], 16)


def test_digests_tell_bytes_apart() -> None:
    assert media_digest(b"x") == media_digest(b"x") != media_digest(b"y")
    assert 0 <= media_digest(b"x") < 2**64


def test_a_block_from_its_images_offsets_hashes_as_from_the_prompt_s_spans() -> None:
    # What an engine's KV event gives (vLLM's extra keys: each image's id and offset in the block).
    whole = local_block_hashes(TOKENS, 16, media=[MediaSpan(A, 20, 20), MediaSpan(B, 36, 8)])
    assert block_hash_with_media(TOKENS[16:32], 1337, [(A, 4)]) == whole[1]
    assert block_hash_with_media(TOKENS[32:48], 1337, [(A, -12), (B, 4)]) == whole[2]
