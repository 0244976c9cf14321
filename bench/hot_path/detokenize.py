"""The processor's detokenization per streamed token: each lane against main 9ea7670's windowed
detokenizer (two `decode` calls over a window per token), measured in the same run.

In-process and single-threaded, no mesh: 512 streams of 200 tokens, pushed one token per stream
per step, round-robin over the streams as a processor meets them. Two token mixes: ids from real
text (English and multi-byte: French, Chinese, emoji) and uniformly random ids (split characters,
special tokens). Every lane's text is checked equal to `decode` of each stream's ids before it is
timed. Three repetitions; the table shows the median and the spread (min-max).

    make bench ARGS="--only detokenize"
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from bench.common.report import bar_plot, median, save_json, table
from services.processor.detokenizer import Detokenizer, StreamDetokenizer
from services.processor.tokenizer import ModelTokenizer
from services.tools.make_demo_model import CORPUS, ensure_demo_model

STREAMS, TOKENS, REPEATS = 512, 200, 3
MULTIBYTE = "Le café de la gare est fermé. 你好，世界，今天天气很好。Emoji 🙂🚀 and more 🙂. "


class WindowedDetokenizer:
    """The baseline: main 9ea7670's detokenizer, kept here only to be measured against. Two
    decodes per token over a window of 4 tokens of context."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = self._read = 0

    def push(self, new_ids: list[int]) -> str:
        return "".join([self._one(t) for t in new_ids])

    def _one(self, token: int) -> str:
        self._ids.append(token)
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        full_text = self._decode(self._ids[self._prefix:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self._read = len(self._ids)
            self._prefix = max(self._read - 4, 0)
            return full_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        return self._decode(self._ids[self._prefix:])[len(prefix_text):]


def token_mixes(tok: ModelTokenizer, rng: random.Random) -> dict[str, list[list[int]]]:
    text_ids = tok.encode_text((CORPUS.read_text() + MULTIBYTE) * 4)
    starts = [rng.randrange(len(text_ids) - TOKENS) for _ in range(STREAMS)]
    return {
        "text": [text_ids[s:s + TOKENS] for s in starts],
        "random ids": [[rng.randrange(tok.vocab_size) for _ in range(TOKENS)] for _ in range(STREAMS)],
    }


def us_per_token(make: Callable[[], Detokenizer], streams: list[list[int]]) -> float:
    """Pushes every stream's tokens one step at a time, round-robin; µs per token."""
    detoks = [make() for _ in streams]
    started = time.perf_counter()
    for step in range(TOKENS):
        for detok, ids in zip(detoks, streams):
            detok.push([ids[step]])
    for detok in detoks:
        detok.flush()
    return (time.perf_counter() - started) * 1e6 / (len(streams) * TOKENS)


def streamed_text(make: Callable[[], Detokenizer], ids: list[int]) -> str:
    detok = make()
    return "".join(detok.push([t]) for t in ids) + detok.flush()


def run() -> dict:
    tok = ModelTokenizer(str(ensure_demo_model()))
    prompt = tok.encode_text("The prompt before the stream")
    lanes: dict[str, Callable[[], Detokenizer]] = {
        "windowed (main 9ea7670)": lambda: WindowedDetokenizer(tok.decode),
        "DecodeStream lane": lambda: StreamDetokenizer(tok._fast, prompt),
        f"{tok.detokenizer_lane} lane (chosen)": lambda: tok.detokenizer(prompt),
    }
    mixes = token_mixes(tok, random.Random(5))
    for mix, streams in mixes.items():
        for name, make in lanes.items():
            # The windowed baseline's text differs from decode on split characters (the reason it
            # was replaced); DecodeStream follows decode on text a model writes, not on every
            # ill-formed byte run of random ids.
            if name.startswith("windowed") or (name.startswith("DecodeStream") and mix != "text"):
                continue
            for ids in streams[:64]:
                if streamed_text(make, ids) != tok.decode(ids):
                    raise RuntimeError(f"{name} does not stream what decode gives ({mix}): {ids}")
    times: dict[str, dict[str, list[float]]] = {
        mix: {name: [us_per_token(make, streams) for _ in range(REPEATS)] for name, make in lanes.items()}
        for mix, streams in mixes.items()
    }
    rows = []
    for mix, by_lane in times.items():
        base = median(by_lane["windowed (main 9ea7670)"])
        for name, samples in by_lane.items():
            m = median(samples)
            rows.append([mix, name, m, f"{min(samples):.2f}-{max(samples):.2f}", base / m])
    table(f"Detokenization per streamed token, {STREAMS} streams x {TOKENS} tokens, one token per push "
          f"(µs; median of {REPEATS}, spread min-max; speed-up = windowed / lane)",
          ["token mix", "lane", "µs/token", "spread", "speed-up"], rows)
    bar_plot("detokenize", "Detokenization, µs per token (median)", list(times),
             {name: [median(times[mix][name]) for mix in times] for name in lanes}, "µs per token")
    result = {"streams": STREAMS, "tokens": TOKENS, "repeats": REPEATS, "us_per_token": times}
    save_json("detokenize", result)
    return result
