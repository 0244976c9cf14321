"""Streaming text: multi-byte characters never show as U+FFFD, stop strings cut exactly."""

from __future__ import annotations

import random

import pytest

from services.processor.detokenizer import IncrementalDetokenizer, StopStrings
from services.processor.tokenizer import ModelTokenizer
from services.tools.make_demo_model import ensure_demo_model


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(str(ensure_demo_model()))


@pytest.mark.parametrize("text", [
    "café naïve Straße",
    "你好，世界。こんにちは",
    "emoji 🙂🚀 and more 🙂",
    "plain ascii text with punctuation: (a + b) * c!",
])
def test_token_by_token_streaming_never_shows_replacement_chars(tokenizer: ModelTokenizer, text: str) -> None:
    ids = tokenizer.encode_text(text)
    assert len(ids) > 3
    detok = IncrementalDetokenizer(tokenizer.decode)
    deltas = [detok.push([i]) for i in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == tokenizer.decode(ids) == text


def test_chat_template_wraps_messages_and_adds_the_assistant_turn(tokenizer: ModelTokenizer) -> None:
    from services.processor.chat_render import ChatPrompt

    ids = tokenizer.encode_chat(ChatPrompt([{"role": "user", "content": "hello"}]))
    text = tokenizer._hf.decode(ids)
    assert text.startswith("<|begin_of_text|><|im_start|>user\nhello<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")


def test_stop_string_inside_one_delta() -> None:
    s = StopStrings(["END"])
    assert s.push("hello END world") == ("hello ", True)


def test_stop_string_split_across_deltas_is_held_back_then_cut() -> None:
    s = StopStrings(["STOP"])
    out1, stopped1 = s.push("abc ST")
    # The last len("STOP") - 1 characters could begin the stop string: held back.
    assert not stopped1 and out1 == "abc"
    out2, stopped2 = s.push("OP tail")
    assert stopped2
    assert out1 + out2 == "abc "


def test_text_that_never_completes_a_stop_string_is_flushed_whole() -> None:
    s = StopStrings(["<end>"])
    emitted = [s.push(chunk)[0] for chunk in ["a<e", "n", "d", "!"]]
    assert "".join(emitted) + s.flush() == "a<end!"


def test_earliest_of_several_stop_strings_wins() -> None:
    s = StopStrings(["xyz", "b"])
    assert s.push("aaxyzb") == ("aa", True)


def test_no_stop_strings_pass_text_straight_through() -> None:
    s = StopStrings([])
    assert s.push("anything") == ("anything", False)


def _streamed(tokenizer: ModelTokenizer, ids: list[int], cuts: list[int]) -> str:
    detok = IncrementalDetokenizer(tokenizer.decode)
    bounds = [0, *sorted(cuts), len(ids)]
    text = "".join(detok.push(ids[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a)
    return text + detok.flush()


def test_the_text_of_a_token_sequence_does_not_depend_on_how_it_was_batched(tokenizer: ModelTokenizer) -> None:
    """Paced streams and resumed streams push tokens in batches of any size; the client must see
    the same text for the same tokens. Random ids include lone bytes of multi-byte characters,
    which decode to U+FFFD differently in a window than one by one."""
    rng = random.Random(7)
    vocab = tokenizer.vocab_size
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        one_by_one = _streamed(tokenizer, ids, list(range(1, len(ids))))
        cuts = rng.sample(range(1, len(ids)), k=rng.randint(0, max(0, len(ids) - 1))) if len(ids) > 1 else []
        assert _streamed(tokenizer, ids, cuts) == one_by_one, ids
        assert _streamed(tokenizer, ids, []) == one_by_one, ids


def test_a_stream_resumed_elsewhere_continues_the_text_exactly(tokenizer: ModelTokenizer) -> None:
    """A processor taking over a stream pushes the tokens the client already has in one batch and
    drops that text; what it emits next must be exactly the rest of the text, whatever batches
    the failed processor had pushed them in (ending mid-character included)."""
    rng = random.Random(11)
    vocab = tokenizer.vocab_size
    for _ in range(400):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(2, 40))]
        whole = _streamed(tokenizer, ids, list(range(1, len(ids))))
        k = rng.randint(1, len(ids) - 1)
        first = IncrementalDetokenizer(tokenizer.decode)
        cuts = sorted(rng.sample(range(1, k), k=rng.randint(0, k - 1))) if k > 1 else []
        bounds = [0, *cuts, k]
        sent = "".join(first.push(ids[a:b]) for a, b in zip(bounds, bounds[1:]))
        taker = IncrementalDetokenizer(tokenizer.decode)
        taker.push(ids[:k])  # already with the client
        rest = taker.push(ids[k:]) + taker.flush()
        assert sent + rest == whole, (ids, k)
