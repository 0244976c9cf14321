"""Streaming detokenization and stop strings.

Byte-level tokenizers split multi-byte characters across tokens; decoding each token alone shows
U+FFFD mid-stream. The detokenizer keeps a short window of ids and releases text only once the
window decodes to whole characters.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"
# Tokens of context decoded before the new ones, so merges across the boundary render correctly.
CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    __slots__ = ("_decode", "_ids", "_prefix_offset", "_read_offset")

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, new_ids: list[int]) -> str:
        """Adds tokens; returns the text they complete (may be empty while a character is split).

        A batch is pushed token by token, so the text released after a token sequence, and what
        is held back, never depend on how the sequence was split into pushes. A processor that
        takes a stream over pushes the tokens the client already has in one batch: it must hold
        back exactly what the failed one held (decoded as one window, a batch ending mid-character
        would release nothing and hold it all, and the next push would send it all again)."""
        if len(new_ids) == 1:
            return self._push_one(new_ids[0])
        return "".join([self._push_one(token) for token in new_ids])

    def _push_one(self, token: int) -> str:
        self._ids.append(token)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT):
            delta = full_text[len(prefix_text) :]
            self._read_offset = len(self._ids)
            self._prefix_offset = max(self._read_offset - CONTEXT_TOKENS, 0)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is left when the stream ends, even if it is not valid UTF-8."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]


class StopStrings:
    """Finds the first stop string in streamed text, holding back what could begin one."""

    __slots__ = ("_hold", "_pending", "_stops")

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped). After a stop, the text ends before the stop string."""
        if not self._stops:
            return text, False
        self._pending += text
        cut = min((i for i in (self._pending.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
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
