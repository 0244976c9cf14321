"""How CPU engines on one host share its cores, and how the launcher hands the shares out."""

from __future__ import annotations

import pytest

from services.engines.cpu_cores import BIND_VARIABLE, core_shares, host_cores
from services.launch import config
from services.launch.plan import plan_children


def cores_of(share: str) -> list[int]:
    return [int(c) for c in share.split(",")]


@pytest.mark.parametrize("cores, engines", [(2, 1), (2, 2), (2, 3), (8, 2), (8, 3), (16, 5), (3, 7)])
def test_shares_are_disjoint_while_cores_last_and_single_cores_in_turn_after(cores: int, engines: int) -> None:
    shares = [cores_of(s) for s in core_shares(list(range(cores)), engines)]
    assert len(shares) == engines
    if engines <= cores:
        flat = [c for share in shares for c in share]
        assert sorted(flat) == list(range(cores))  # every core used, none twice
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    else:
        assert all(len(share) == 1 for share in shares)
        assert [share[0] for share in shares] == [i % cores for i in range(engines)]


def test_the_cores_are_the_ones_given_not_numbered_from_zero() -> None:
    assert core_shares([4, 5, 6, 7], 2) == ["4,5", "6,7"]


def test_hyperthread_siblings_count_as_one_core(monkeypatch: pytest.MonkeyPatch) -> None:
    # 4 cores with 2 threads each, numbered as Linux usually does on x86: cpuN's sibling is cpuN+4.
    monkeypatch.setattr("os.sched_getaffinity", lambda _: set(range(8)))
    cores = host_cores(lambda cpu: (0, cpu % 4))
    assert cores == [0, 1, 2, 3]
    assert core_shares(cores, 2) == ["0,1", "2,3"]  # never the two threads of one core apart


def test_cpus_of_unknown_topology_are_cores_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda _: {2, 3})
    assert host_cores(lambda cpu: None) == [2, 3]


def test_no_engines_or_no_cores_is_an_error() -> None:
    with pytest.raises(ValueError):
        core_shares([0, 1], 0)
    with pytest.raises(ValueError):
        core_shares([], 1)


def binds(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str | None]:
    monkeypatch.setattr("services.launch.plan.host_cores", lambda: [0, 1, 2, 3])
    children = plan_children(config.load(argv), "http://127.0.0.1:2379", "/m")
    return {f"{c.component}-{i}": (c.env or {}).get(BIND_VARIABLE) for i, c in enumerate(children)
            if c.component.endswith("-worker")}


def test_the_launcher_gives_each_vllm_worker_its_own_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BIND_VARIABLE, raising=False)
    got = binds(["--engine", "vllm", "--decode-workers", "2", "--prefill-workers", "1"], monkeypatch)
    assert sorted(got.values()) == ["0,1", "2", "3"], got


def test_an_operators_binding_a_single_worker_and_the_mocker_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BIND_VARIABLE, "nobind")
    assert set(binds(["--engine", "vllm"], monkeypatch).values()) == {"nobind"}
    monkeypatch.delenv(BIND_VARIABLE)
    # One engine on the host: vLLM's own binding, which keeps a core for its scheduler.
    assert set(binds(["--engine", "vllm", "--prefill-workers", "0"], monkeypatch).values()) == {None}
    assert set(binds(["--engine", "mocker", "--decode-workers", "2"], monkeypatch).values()) == {None}
