"""`python -m services.kv_router replay`, run in-process on a two-block trace: by default it replays
through the index a router serves with (index_choice.py), and the Python radix tree stays a choice."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from services.kv_protocol.hashing import chained_block_hashes, local_block_hashes
from services.kv_router import replay
from services.routing.index_choice import new_index
from services.routing.radix_tree import RadixTree

BS = 4
TOKENS = list(range(100, 108))  # two full blocks


def write_trace(root: Path) -> list[str]:
    """The flags naming a trace of one worker storing TOKENS' blocks and one query of them."""
    blocks = [{"block_hash": s, "tokens_hash": t}
              for s, t in zip(chained_block_hashes(TOKENS, BS), local_block_hashes(TOKENS, BS))]
    event = {"worker_id": 7, "event": {"event_id": 1, "data": {"stored": {"parent_hash": None, "blocks": blocks}}}}
    (root / "events.jsonl").write_text(json.dumps(event) + "\n")
    (root / "queries.jsonl").write_text(json.dumps({"query_id": 1, "token_ids": TOKENS}) + "\n")
    return ["--events", str(root / "events.jsonl"), "--queries", str(root / "queries.jsonl"),
            "--block-size", str(BS), "--out", str(root / "scores.jsonl")]


def run(argv: list[str], root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[str, list[dict]]:
    """The summary's `index` and the scores written."""
    replay.main(argv)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    scores = [json.loads(line)["scores"] for line in (root / "scores.jsonl").read_text().splitlines()]
    return summary["index"], scores


def test_replay_runs_the_routers_own_index_by_default(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    flags = write_trace(tmp_path)
    routers = "radix" if isinstance(new_index(), RadixTree) else "native"
    if os.environ.get("KVMESH_REQUIRE_NATIVE") == "1":  # make test and make test-unit: built, so chosen
        assert routers == "native"
    assert run(flags, tmp_path, capsys) == (routers, [{"7": 2}])
    # As a router does: KVMESH_INDEX=python runs the Python radix tree.
    monkeypatch.setenv("KVMESH_INDEX", "python")
    assert run(flags, tmp_path, capsys) == ("radix", [{"7": 2}])


def test_the_python_radix_tree_stays_a_choice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run([*write_trace(tmp_path), "--index", "radix"], tmp_path, capsys) == ("radix", [{"7": 2}])
