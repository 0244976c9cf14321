"""The demo model is made again where it was made from another spec (an older default context
length), and left alone where it was made from this one (services/tools/make_demo_model.py)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from services.tools import make_demo_model
from services.tools.make_demo_model import SPEC_FILE, DemoModelSpec, built_spec, ensure_demo_model


def built_as(path: Path, spec: DemoModelSpec | None) -> Path:
    """A stand-in model directory (no weights) that says it was made from `spec` (None: says nothing)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    if spec is not None:
        (path / SPEC_FILE).write_text(json.dumps(asdict(spec)))
    return path


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[DemoModelSpec]:
    """The specs `ensure_demo_model` builds, recorded instead of built (a build takes seconds)."""
    made: list[DemoModelSpec] = []

    def write(out: Path, spec: DemoModelSpec = DemoModelSpec(), replace: bool = False) -> Path:
        assert replace, "an existing model is replaced, not kept"
        made.append(spec)
        return out

    monkeypatch.setattr(make_demo_model, "write_demo_model", write)
    return made


@pytest.mark.parametrize("name, found, rebuilt", [
    ("built from this spec", DemoModelSpec(), False),
    ("built with the old 4096-token context", DemoModelSpec(max_context=4096), True),
    ("built before models recorded their spec", None, True),
])
def test_a_demo_model_of_another_spec_is_made_again(tmp_path: Path, builds: list[DemoModelSpec], name: str,
                                                    found: DemoModelSpec | None, rebuilt: bool) -> None:
    model = built_as(tmp_path / "kvmesh-demo", found)
    (model / "chat_template.jinja").write_text(make_demo_model.CHAT_TEMPLATE)
    assert ensure_demo_model(model) == model.resolve()
    assert builds == ([DemoModelSpec()] if rebuilt else []), name


def test_the_default_demo_model_takes_an_agents_prompt() -> None:
    assert DemoModelSpec().max_context >= 65536


def test_the_spec_a_model_was_built_from_is_read_back(tmp_path: Path) -> None:
    assert built_spec(tmp_path / "none") is None
    assert built_spec(built_as(tmp_path / "m", DemoModelSpec(max_context=8192))) == asdict(DemoModelSpec(max_context=8192))
