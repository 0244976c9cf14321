"""Streaming detokenization and stop strings.

A stream's text is what the tokenizer's `decode` gives for all its tokens, released as early as
possible: byte-level tokenizers split multi-byte characters across tokens, so a character is
released once its last byte arrived, never as U+FFFD mid-stream. The text released after a token
sequence, and what is held back, never depend on how the sequence was split into pushes: a
processor that takes a stream over pushes the tokens the client already has in one batch and
holds back exactly what the failed one held.

Two lanes, chosen once per tokenizer (`ModelTokenizer.detokenizer`):
- `ByteTableDetokenizer`: byte-level BPE, a table look-up per token (see byte_table.py);
- `StreamDetokenizer`: any other tokenizer (SentencePiece with byte fallback, WordPiece, ...),
  through `tokenizers`' `DecodeStream`, primed with the end of the prompt as vLLM primes it, so a
  first token's leading space is the one `decode(prompt + output)` shows (see the class for the
  one kind of output it cannot follow exactly).
"""

from __future__ import annotations

import codecs
import logging
from collections.abc import Sequence
from typing import Any, Protocol

log = logging.getLogger(__name__)

# What `DecodeStream` raises when a new token changes text it already released.
INVALID_PREFIX = "Invalid prefix encountered"
REPLACEMENT = "\ufffd"
# Prompt tokens a `StreamDetokenizer` starts from: context enough for a decoder that strips or
# merges at the start of a sequence, without decoding a long prompt per stream.
PROMPT_CONTEXT_TOKENS = 8
# Tokens one character can span (UTF-8's longest, spelled in byte-fallback tokens).
MAX_CHAR_TOKENS = 4


class Detokenizer(Protocol):
    def push(self, new_ids: list[int]) -> str:
        """Adds tokens; returns the text they complete (empty while a character is split)."""
        ...

    def flush(self) -> str:
        """Whatever is held back when the stream ends (an unfinished character as U+FFFD)."""
        ...


class ByteTableDetokenizer:
    __slots__ = ("_decode", "_table")

    def __init__(self, table: list[bytes]) -> None:
        self._table = table
        # Holds back an unfinished character's bytes; replaces each ill-formed subpart with one
        # U+FFFD, as `decode` does: the same text however the bytes are split.
        self._decode = codecs.getincrementaldecoder("utf-8")("replace").decode

    def push(self, new_ids: list[int]) -> str:
        table = self._table
        try:
            if len(new_ids) == 1:
                return self._decode(table[new_ids[0]])
            return self._decode(b"".join([table[i] for i in new_ids]))
        except IndexError:
            # An id past the vocabulary decodes to nothing, as in `decode`.
            size = len(table)
            return self._decode(b"".join([table[i] for i in new_ids if 0 <= i < size]))

    def flush(self) -> str:
        return self._decode(b"", True)


class StreamDetokenizer:
    """Streams what `decode(context + output)` adds to `decode(context)`, through DecodeStream.

    The context is the prompt's last `PROMPT_CONTEXT_TOKENS` tokens, moved back to the start of a
    character (a byte-fallback decoder shows a whole run of byte tokens as U+FFFDs when it begins
    inside a character), less trailing tokens while its text ends in U+FFFD (DecodeStream keeps no
    prefix after such text and would release the prompt itself). One thing no stream can follow:
    an ill-formed run of byte-fallback tokens, which `decode` shows as one U+FFFD per token once
    the run is known to be ill-formed, after text was released."""

    __slots__ = ("_context", "_emitted", "_ids", "_stream", "_tokenizer")

    def __init__(self, tokenizer: Any, prompt: Sequence[int]) -> None:
        """`tokenizer`: a `tokenizers.Tokenizer`; `prompt`: the ids before the stream's first."""
        self._tokenizer = tokenizer
        self._context = self._context_of(prompt)
        self._stream = self._new_stream(self._context)
        self._ids: list[int] = []
        self._emitted = 0  # characters released so far

    def _context_of(self, ids: Sequence[int]) -> list[int]:
        def text(start: int, end: int) -> str:
            return self._tokenizer.decode(list(ids[start:end]), skip_special_tokens=True)

        start, end = max(0, len(ids) - PROMPT_CONTEXT_TOKENS), len(ids)
        for _ in range(MAX_CHAR_TOKENS):
            if start == 0 or not text(start, end).startswith(REPLACEMENT):
                break
            start -= 1
        while end > start and text(start, end).endswith(REPLACEMENT):
            end -= 1
        return list(ids[start:end])

    @staticmethod
    def _new_stream(prefix: list[int]) -> Any:
        from tokenizers.decoders import DecodeStream

        return DecodeStream(ids=list(prefix), skip_special_tokens=True)

    def push(self, new_ids: list[int]) -> str:
        parts = []
        for token in new_ids:
            self._ids.append(token)
            try:
                text = self._stream.step(self._tokenizer, token)
            except Exception as exc:
                if INVALID_PREFIX not in str(exc):
                    raise
                text = self._restart()
            if text:
                parts.append(text)
                self._emitted += len(text)  # before the next token: a restart counts from here
        return "".join(parts)

    def _restart(self) -> str:
        """A new token rewrote text already released (vLLM meets this too): start a stream after
        everything so far and release what `decode` adds beyond the released text."""
        log.warning("detokenizer: DecodeStream met an invalid prefix; restarting it after %d tokens", len(self._ids))
        self._stream = self._new_stream(self._context_of(self._context + self._ids))
        return self._remainder()

    def _remainder(self) -> str:
        decode = self._tokenizer.decode
        full = decode(self._context + self._ids, skip_special_tokens=True)
        start = len(decode(self._context, skip_special_tokens=True)) + self._emitted
        return full[start:]

    def flush(self) -> str:
        out = self._remainder()
        self._emitted += len(out)
        return out


class StopStrings:
    """Finds the first stop string in streamed text, holding back what could begin one."""

    __slots__ = ("_hold", "_pending", "_stops", "matched")

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""
        # The stop string found, once `push` says it stopped (the earliest in the text; the first
        # listed of those starting there).
        self.matched = ""

    @property
    def active(self) -> bool:
        """Whether there is any stop string to look for (if not, `push` returns its text as is)."""
        return bool(self._stops)

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped). After a stop, the text ends before the stop string."""
        if not self._stops:
            return text, False
        self._pending += text
        found = [(i, n) for n, i in enumerate(self._pending.find(s) for s in self._stops) if i >= 0]
        if found:
            cut, which = min(found)
            self.matched = self._stops[which]
            out, self._pending = self._pending[:cut], ""
            return out, True
        safe = len(self._pending) - self._hold
        if safe <= 0:
            return "", False
        out, self._pending = self._pending[:safe], self._pending[safe:]
        return out, False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out
