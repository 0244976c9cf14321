"""Streaming text: multi-byte characters never show as U+FFFD, stop strings cut exactly."""

from __future__ import annotations

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
    from services.processor.tokenizer import ChatTurn

    ids = tokenizer.encode_chat([ChatTurn("user", "hello")])
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
