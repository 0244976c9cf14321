"""Streaming text: the text of a stream is what `decode` gives for its tokens, however they were
split into steps or taken over; multi-byte characters never show as U+FFFD; stop strings cut
exactly. Both detokenizer lanes: the byte table (the demo model's byte-level BPE) and DecodeStream
(a SentencePiece-style tokenizer with byte fallback, built here)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from services.processor.byte_table import CHECK_TEXT, _first_mismatch, build_byte_table
from services.processor.detokenizer import Detokenizer, StopStrings, StreamDetokenizer
from services.processor.tokenizer import ModelTokenizer
from services.tools.make_demo_model import CORPUS, ensure_demo_model


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(str(ensure_demo_model()))


def sentencepiece_tokenizer() -> Any:
    """Llama 2's layout: BPE over "▁"-marked words, the 256 byte tokens `<0xNN>` for what the
    vocabulary lacks, and the decoder chain that turns them back (Replace, ByteFallback, Fuse, Strip)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace()
    base.train([str(CORPUS)], trainers.BpeTrainer(vocab_size=700, special_tokens=["<unk>", "<s>", "</s>"],
                                                  show_progress=False))
    config = json.loads(base.to_str())
    vocab = config["model"]["vocab"]
    first_byte = len(vocab)
    vocab.update({f"<0x{b:02X}>": first_byte + b for b in range(256)})
    config["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(config))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


@dataclass(frozen=True)
class Lane:
    """One detokenizer lane: how to start a stream, what `decode` says it must stream, and
    random token sequences to try it on."""

    new: Callable[[list[int]], Detokenizer]
    expected: Callable[[list[int], list[int]], str]
    random_ids: Callable[[random.Random, int], list[int]]


def byte_table_lane(tokenizer: ModelTokenizer) -> Lane:
    vocab = tokenizer.vocab_size
    # Any id at all: lone bytes of multi-byte characters, special tokens, ids the tokenizer lacks.
    return Lane(tokenizer.detokenizer, lambda prompt, ids: tokenizer.decode(ids),
                lambda rng, n: [rng.randrange(vocab) for _ in range(n)])


def decode_stream_lane() -> Lane:
    tok = sentencepiece_tokenizer()
    vocab = tok.get_vocab()
    pieces = [i for t, i in vocab.items() if not t.startswith("<")]
    byte_tokens = {b: vocab[f"<0x{b:02X}>"] for b in range(256)}
    special = [vocab["<s>"], vocab["</s>"]]

    def random_ids(rng: random.Random, n: int) -> list[int]:
        """Word pieces, special tokens, and characters of 1-4 UTF-8 bytes spelled as byte tokens
        (the byte fallback's split characters). A run of byte tokens that is not UTF-8 decodes to
        one U+FFFD per token, retroactively, which no stream can follow; models do not write it."""
        ids: list[int] = []
        while len(ids) < n:
            kind = rng.random()
            if kind < 0.6:
                ids.append(rng.choice(pieces))
            elif kind < 0.7:
                ids.append(rng.choice(special))
            else:
                char = chr(rng.choice([rng.randrange(0x80, 0x800), rng.randrange(0x4E00, 0x9FFF),
                                       rng.randrange(0x1F300, 0x1FAFF)]))
                ids.extend(byte_tokens[b] for b in char.encode())
        return ids

    def expected(prompt: list[int], ids: list[int]) -> str:
        return tok.decode(prompt + ids, skip_special_tokens=True)[len(tok.decode(prompt, skip_special_tokens=True)):]

    return Lane(lambda prompt: StreamDetokenizer(tok, prompt), expected, random_ids)


@pytest.fixture(scope="module", params=["byte table", "DecodeStream"])
def lane(request: pytest.FixtureRequest, tokenizer: ModelTokenizer) -> Lane:
    return byte_table_lane(tokenizer) if request.param == "byte table" else decode_stream_lane()


def test_the_demo_model_streams_through_its_byte_table_and_sentencepiece_through_decode_stream(
        tokenizer: ModelTokenizer) -> None:
    assert tokenizer.detokenizer_lane == "byte table"
    assert build_byte_table(sentencepiece_tokenizer(), 1000) is None


@pytest.mark.parametrize("token", ["a whole character", "part of a character"])
def test_a_byte_table_that_differs_from_decode_is_caught(tokenizer: ModelTokenizer, token: str) -> None:
    """Even a wrong byte in a token holding part of a character, which decodes to U+FFFD alone
    whatever the byte."""
    table = build_byte_table(tokenizer._fast, tokenizer.vocab_size)
    assert table is not None and _first_mismatch(tokenizer._fast, table, seed=0) is None
    if token == "a whole character":
        wrong_id, wrong_bytes = tokenizer.encode_text("a")[0], b"b"
    else:
        wrong_id = next(i for i in tokenizer._fast.encode(CHECK_TEXT, add_special_tokens=False).ids
                        if len(table[i]) == 1 and table[i][0] >= 0xC0)  # a lone lead byte
        wrong_bytes = bytes([table[wrong_id][0] ^ 1])
    wrong = list(table)
    wrong[wrong_id] = wrong_bytes
    assert _first_mismatch(tokenizer._fast, wrong, seed=0) is not None


@pytest.mark.parametrize("text", [
    "café naïve Straße",
    "你好，世界。こんにちは",
    "emoji 🙂🚀 and more 🙂",
    "plain ascii text with punctuation: (a + b) * c!",
])
def test_token_by_token_streaming_never_shows_replacement_chars(tokenizer: ModelTokenizer, text: str) -> None:
    ids = tokenizer.encode_text(text)
    assert len(ids) > 3
    detok = tokenizer.detokenizer([])
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


def _streamed(detok: Detokenizer, ids: list[int], cuts: list[int]) -> str:
    bounds = [0, *sorted(cuts), len(ids)]
    text = "".join(detok.push(ids[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a)
    return text + detok.flush()


def _random_cuts(rng: random.Random, n: int) -> list[int]:
    return rng.sample(range(1, n), k=rng.randint(0, n - 1)) if n > 1 else []


def test_a_stream_is_exactly_what_decode_gives_however_it_was_split_into_steps(lane: Lane) -> None:
    """Paced streams and resumed streams push tokens in batches of any size; the client must see
    the text `decode` gives for all the tokens, for any split."""
    rng = random.Random(7)
    for _ in range(300):
        prompt = lane.random_ids(rng, rng.randint(0, 12))
        ids = lane.random_ids(rng, rng.randint(1, 40))
        expected = lane.expected(prompt, ids)
        assert _streamed(lane.new(prompt), ids, list(range(1, len(ids)))) == expected, (prompt, ids)
        assert _streamed(lane.new(prompt), ids, _random_cuts(rng, len(ids))) == expected, (prompt, ids)
        assert _streamed(lane.new(prompt), ids, []) == expected, (prompt, ids)


def test_a_stream_taken_over_mid_character_continues_the_text_exactly(lane: Lane) -> None:
    """A processor taking over a stream pushes the tokens the client already has in one batch and
    drops that text; what it emits next must be exactly the rest of the text, whatever batches
    the failed processor had pushed them in (ending mid-character included)."""
    rng = random.Random(11)
    for _ in range(400):
        prompt = lane.random_ids(rng, rng.randint(0, 12))
        ids = lane.random_ids(rng, rng.randint(2, 40))
        k = rng.randint(1, len(ids) - 1)
        first = lane.new(prompt)
        bounds = [0, *sorted(_random_cuts(rng, k)), k]
        sent = "".join(first.push(ids[a:b]) for a, b in zip(bounds, bounds[1:]))
        taker = lane.new(prompt)
        taker.push(ids[:k])  # already with the client
        rest = taker.push(ids[k:]) + taker.flush()
        assert sent + rest == lane.expected(prompt, ids), (prompt, ids, k)


def test_decode_stream_text_does_not_depend_on_the_split_even_for_ill_formed_byte_runs() -> None:
    """Random ids of a byte-fallback tokenizer make byte runs that are not UTF-8, which `decode`
    renders retroactively and no stream can follow; the stream's own text must still not depend
    on how the ids were pushed (a takeover pushes many at once, and DecodeStream may restart)."""
    tok = sentencepiece_tokenizer()
    rng = random.Random(5)
    size = tok.get_vocab_size()
    for _ in range(400):
        prompt = [rng.randrange(size) for _ in range(rng.randint(0, 10))]
        ids = [rng.randrange(size) for _ in range(rng.randint(1, 30))]
        one_by_one = _streamed(StreamDetokenizer(tok, prompt), ids, list(range(1, len(ids))))
        assert _streamed(StreamDetokenizer(tok, prompt), ids, []) == one_by_one, (prompt, ids)
        assert _streamed(StreamDetokenizer(tok, prompt), ids, _random_cuts(rng, len(ids))) == one_by_one, (prompt, ids)


@pytest.mark.parametrize("ending", ["a dangling byte", "a replacement character"])
def test_a_prompt_whose_text_ends_in_a_replacement_character_does_not_leak_into_the_output(ending: str) -> None:
    tok = sentencepiece_tokenizer()
    vocab = tok.get_vocab()
    prompt = tok.encode("the router keeps a tree").ids
    prompt += [vocab["<0xE4>"]] if ending == "a dangling byte" else [vocab[f"<0x{b:02X}>"] for b in "\ufffd".encode()]
    ids = tok.encode("blocks of every worker").ids
    streamed = _streamed(StreamDetokenizer(tok, prompt), ids, [])
    assert "router" not in streamed and streamed.strip().endswith("worker"), streamed


def test_stop_strings_name_the_one_that_matched_first_in_the_text() -> None:
    s = StopStrings(["world", "lo w"])
    assert s.push("hel") == ("", False) and s.matched == ""
    assert s.push("lo world") == ("hel", True)
    assert s.matched == "lo w"  # earlier in the text than "world"
