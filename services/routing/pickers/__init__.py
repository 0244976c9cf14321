"""The router's modes, one picker each, by name: the name a router is started with selects the
class here, so adding a mode is adding a picker and a line to `PICKERS`.

`make_picker` builds the one picker a router uses. Every mode that draws chance draws it from
the router's single seeded generator, so a seeded router repeats its choices.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from services.routing.cost_function import CostWeights
from services.routing.pickers.base import PickContext, Picker
from services.routing.pickers.kv import KvPicker
from services.routing.pickers.random_choice import RandomPicker
from services.routing.pickers.round_robin import RoundRobinPicker

PickerFactory = Callable[[random.Random, CostWeights], Picker]

PICKERS: dict[str, PickerFactory] = {
    "kv": lambda rng, weights: KvPicker(rng, weights),
    "round-robin": lambda rng, weights: RoundRobinPicker(),
    "random": lambda rng, weights: RandomPicker(rng),
}
ROUTER_MODES: tuple[str, ...] = tuple(PICKERS)


def make_picker(mode: str, rng: random.Random, weights: CostWeights) -> Picker:
    """The picker of router mode `mode`; ValueError for a mode not in `ROUTER_MODES`."""
    factory = PICKERS.get(mode)
    if factory is None:
        raise ValueError(f"router mode {mode!r} is not one of {', '.join(ROUTER_MODES)}")
    return factory(rng, weights)


__all__ = ["PICKERS", "ROUTER_MODES", "KvPicker", "PickContext", "Picker", "PickerFactory", "RandomPicker",
           "RoundRobinPicker", "make_picker"]
