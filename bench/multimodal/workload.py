"""An agent-like image trace: sessions that resend their screenshots turn after turn, beside
background requests of one image each, all behind the same agent system prompt.

Each session's chat grows by one user turn (one of its screenshots, in turn, then its text, as a
pasted screenshot comes) and a short assistant answer; every request resends the whole history, its
images included, as agent clients do. All sessions share the system prompt, so a router that
cannot tell images apart sees every worker that served any session as holding the same prefix.
"""

from __future__ import annotations

import base64
import io
import random
from dataclasses import dataclass
from functools import cache

WORDS = ("read the file then run the tests and fix what fails keep the diff small explain each change "
         "the build uses make and the service starts on port eight thousand with a config in yaml").split()


@dataclass(frozen=True)
class Workload:
    sessions: int = 16
    turns: int = 4
    screenshots_per_session: int = 2
    background: int = 24  # one-image requests beside the sessions
    system_words: int = 900
    turn_words: int = 24
    rate_per_s: float = 6.0  # session starts and background requests, Poisson
    think_s: float = 0.5  # between a session's answer and its next turn


@dataclass(frozen=True)
class Request:
    key: str  # "s3t2" (session 3, turn 2) or "bg5"
    messages: list[dict]


@cache
def screenshot(seed: int) -> bytes:
    """A 640x400 "screenshot": a background and a few panels, different for every seed (PNG)."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    image = Image.new("RGB", (640, 400), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    for _ in range(6):
        x, y = rng.randrange(600), rng.randrange(360)
        draw.rectangle((x, y, x + rng.randrange(20, 200), y + rng.randrange(10, 120)),
                       fill=tuple(rng.randrange(256) for _ in range(3)))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _user(text: str, image: bytes) -> dict:
    """A turn as an agent sends a pasted screenshot: the image, then the words about it."""
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}


def system_prompt(w: Workload, seed: int) -> dict:
    return {"role": "system", "content": _text(random.Random(seed), w.system_words)}


def session_turns(w: Workload, seed: int, session: int) -> list[Request]:
    """A session's requests in order, each with the whole history before it."""
    rng = random.Random(seed * 1000 + session)
    shots = [screenshot(seed * 100_000 + session * 100 + k) for k in range(w.screenshots_per_session)]
    history = [system_prompt(w, seed)]
    out = []
    for turn in range(w.turns):
        history = [*history, _user(_text(rng, w.turn_words), shots[turn % len(shots)])]
        out.append(Request(f"s{session}t{turn}", history))
        history = [*history, {"role": "assistant", "content": f"Noted step {turn}: {_text(rng, 8)}"}]
    return out


def background(w: Workload, seed: int) -> list[Request]:
    rng = random.Random(seed * 7 + 1)
    out = []
    for i in range(w.background):
        image = screenshot(seed * 100_000 + 90_000 + i)
        out.append(Request(f"bg{i}", [system_prompt(w, seed), _user(_text(rng, w.turn_words), image)]))
    return out
