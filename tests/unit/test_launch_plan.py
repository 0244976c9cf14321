"""The launcher's plan of children (services/launch/plan.py) for the processors' placement."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.launch import config
from services.launch.plan import plan_children

ETCD = "http://127.0.0.1:2379"


def test_embedded_processors_start_no_processor_and_each_frontend_hosts_one_with_its_flags() -> None:
    children = plan_children(config.load(["--embed-processors", "--frontends", "2", "--routing", "local",
                                          "--migration-limit", "1"]), ETCD, "/m")
    assert [c.component for c in children].count("processor") == 0
    frontends = [c for c in children if c.component == "frontend"]
    assert len(frontends) == 2
    for frontend in frontends:
        argv = frontend.argv
        hosted = argv[argv.index("--embed-processor"):]
        assert hosted[:3] == ["--embed-processor", "--model", "/m"]
        assert "--migration-limit" in hosted and "--routing" in hosted and "--reuse-port" in argv


def test_a_separate_processor_is_the_default_and_frontends_host_none() -> None:
    children = plan_children(config.load([]), ETCD, "/m")
    assert [c.component for c in children].count("processor") == 1
    (frontend,) = [c for c in children if c.component == "frontend"]
    assert "--embed-processor" not in frontend.argv and "--model" not in frontend.argv


def test_a_processor_count_with_embedded_processors_is_refused_naming_both_flags(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        config.load(["--embed-processors", "--processors", "2"])
    said = capsys.readouterr().err
    assert refused.value.code == 2 and "--processors" in said and "--embed-processors" in said, said


def test_encode_workers_start_first_and_the_aggregated_decode_workers_take_features_over_nixl() -> None:
    children = plan_children(config.load(["--engine", "mocker", "--prefill-workers", "0", "--encode-workers", "2"]),
                             ETCD, "/m")
    components = [c.component for c in children]
    assert components.index("encode-worker") < components.index("decode-worker")
    (encode,) = [c for c in children if c.component == "encode-worker"]  # the mocker's workers share a process
    assert encode.argv[encode.argv.index("--num-workers") + 1] == "2" and "nixl" in encode.argv
    (decode,) = [c for c in children if c.component == "decode-worker"]
    assert "--no-remote-prefill" in decode.argv and decode.argv[decode.argv.index("--kv-transfer") + 1] == "nixl"
    assert "encode-worker" not in [c.component for c in plan_children(config.load(["--engine", "mocker"]), ETCD, "/m")]


@pytest.mark.parametrize("engine", ["mocker", "vllm"])
def test_a_local_planner_given_encode_workers_starts_them_and_sizes_their_pool(engine: str, tmp_path: Path) -> None:
    cfg = config.load(["--engine", engine, "--encode-workers", "1", "--planner", "local"])
    children = plan_children(cfg, ETCD, "/m", run_dir=tmp_path)
    components = [c.component for c in children]
    assert components.index("encode-worker") < components.index("decode-worker")
    (encode,) = [c for c in children if c.component == "encode-worker"]
    assert "services.encode_worker" in encode.argv and "--switchable" not in encode.argv
    (planner,) = [c for c in children if c.component == "planner"]
    assert planner.argv[planner.argv.index("--max-encode-workers") + 1] == "4"
    if engine == "vllm":  # every worker the planner runs reads the features where encode workers write them
        dirs = {c.argv[c.argv.index("--encoder-cache-dir") + 1] for c in children if c.component.endswith("-worker")}
        assert dirs == {str((tmp_path / "encoder-cache").resolve())}
    # Without encode workers (or a planner told to size their pool) there is no pool to size.
    plain = plan_children(config.load(["--engine", engine, "--planner", "local"]), ETCD, "/m", run_dir=tmp_path)
    (planner,) = [c for c in plain if c.component == "planner"]
    assert "--max-encode-workers" not in planner.argv
    assert not any("--encoder-cache-dir" in c.argv for c in plain)


def test_vllm_encode_workers_share_a_feature_directory_with_the_workers_that_prefill(tmp_path: Path) -> None:
    children = plan_children(config.load(["--engine", "vllm", "--encode-workers", "1"]), ETCD, "/m", run_dir=tmp_path)
    dirs = {c.component: c.argv[c.argv.index("--encoder-cache-dir") + 1] for c in children
            if c.component.endswith("-worker")}
    assert set(dirs) == {"encode-worker", "decode-worker", "prefill-worker"}
    assert set(dirs.values()) == {str(tmp_path / "encoder-cache")}
    (encode,) = [c for c in children if c.component == "encode-worker"]
    assert encode.argv[encode.argv.index("--kv-transfer") + 1] == "none"  # its engine runs the encoder only
