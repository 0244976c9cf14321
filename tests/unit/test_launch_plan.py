"""The launcher's plan of children (services/launch/plan.py) for the processors' placement."""

from __future__ import annotations

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
