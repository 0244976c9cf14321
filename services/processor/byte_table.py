"""The bytes each token id contributes to decoded text, for byte-level BPE tokenizers.

A byte-level BPE tokenizer (GPT-2, Llama 3, Qwen, the demo model) decodes a sequence by mapping
every token to fixed bytes, joining them and reading the result as UTF-8, with U+FFFD for every
maximal ill-formed subpart. A token's bytes do not depend on its neighbours, so streaming text is
a table look-up per token plus an incremental UTF-8 decoder that holds back an unfinished
character: about 0.2 µs per token against two `decode` calls over a window (6 µs).

The table is built from the vocabulary with the rule the `tokenizers` ByteLevel decoder applies
(a token whose every character is in the byte-level alphabet maps to those bytes; any other, an
added token such as `<tool_call>` written as itself, to its UTF-8; a special token to nothing,
since kvmesh decodes with `skip_special_tokens`), and then checked against the tokenizer's own
`decode`: every id alone and random sequences. A tokenizer it does not fit gets no table, and its
streams take the general lane (`DecodeStream`).
"""

from __future__ import annotations

import logging
import random
from typing import Any

log = logging.getLogger(__name__)

# Random sequences decoded both ways before a table is trusted (ids drawn from the whole
# vocabulary, special tokens and split characters included).
CHECK_SEQUENCES = 64
CHECK_LENGTH = 48
# Text whose tokens spell multi-byte characters in pieces: a wrong byte in a token that holds
# part of a character shows only where the whole character is decoded (alone it is U+FFFD
# whichever byte it is).
CHECK_TEXT = "Le café de la gare, Straße, naïve. 你好，世界。こんにちは。Ёлка. 🙂🚀 emoji and 👩‍💻 more."


def byte_level_alphabet() -> dict[str, int]:
    """The byte-level alphabet: which printable character stands for each byte (GPT-2's scheme:
    printable Latin-1 bytes stand for themselves, the rest are shifted past U+00FF in order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars: dict[str, int] = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + shifted)] = b
            shifted += 1
    return chars


def build_byte_table(tokenizer: Any, size: int, seed: int = 0) -> list[bytes] | None:
    """The bytes of every id below `size` (ids the tokenizer does not know decode to nothing),
    or None where the tokenizer is not plain byte-level BPE or the table disagrees with `decode`.
    `tokenizer` is a `tokenizers.Tokenizer`."""
    decoder = tokenizer.decoder
    if decoder is None or type(decoder).__name__ != "ByteLevel":
        return None
    alphabet = byte_level_alphabet()
    special = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    table: list[bytes] = []
    for i in range(size):
        token = tokenizer.id_to_token(i)
        if token is None or i in special:
            table.append(b"")
        elif all(c in alphabet for c in token):
            table.append(bytes(alphabet[c] for c in token))
        else:
            table.append(token.encode())
    mismatch = _first_mismatch(tokenizer, table, seed)
    if mismatch is not None:
        log.info("detokenizer: the byte table differs from the tokenizer's decode (%s); streams use DecodeStream",
                 mismatch)
        return None
    return table


def _first_mismatch(tokenizer: Any, table: list[bytes], seed: int) -> str | None:
    singles = [[i] for i in range(len(table))]
    rng = random.Random(seed)
    sequences = [[rng.randrange(len(table)) for _ in range(CHECK_LENGTH)] for _ in range(CHECK_SEQUENCES)]
    text_ids = tokenizer.encode(CHECK_TEXT, add_special_tokens=False).ids
    sequences += [text_ids[start:] for start in range(min(len(text_ids), 16))]
    decoded = tokenizer.decode_batch(singles + sequences, skip_special_tokens=True)
    for ids, text in zip(singles + sequences, decoded, strict=True):
        if b"".join([table[i] for i in ids]).decode("utf-8", "replace") != text:
            return f"ids {ids[:8]}{'...' if len(ids) > 8 else ''}"
    return None
