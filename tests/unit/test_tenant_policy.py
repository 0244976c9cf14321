"""Tenants' policies from TOML, their reload, and the limits they set, as tables."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gen.kvmesh.v1 import common_pb2
from services.config_error import ConfigError
from services.routing.admission.tenant_policy import PolicyFile, TenantPolicies, TenantPolicy
from services.routing.admission.tenant_usage import WINDOW_S, TenantUsage

GOOD = """
[default]
weight = 2
max_concurrency = 8

[tenants.acme]
weight = 4.5
tokens_per_minute = 1000
"""


def test_a_policy_file_names_defaults_and_tenants() -> None:
    policies = TenantPolicies.parse(GOOD)
    assert policies.of("someone") == TenantPolicy(weight=2, max_concurrency=8)
    assert policies.of("acme") == TenantPolicy(weight=4.5, tokens_per_minute=1000)
    assert TenantPolicies.parse("").of("x") == TenantPolicy()


@pytest.mark.parametrize(("text", "says"), [
    ("[default\n", "not TOML"),
    ("[defaults]\n", "unknown table [defaults]"),
    ("[default]\nweight = 0\n", "[default]: weight must be a number > 0"),
    ("[tenants.a]\nmax_concurrency = -1\n", "[tenants.a]: max_concurrency must be a whole number >= 0"),
    ("[tenants.a]\ntokens_per_minute = 1.5\n", "tokens_per_minute must be a whole number"),
    ("[tenants.a]\nburst = 3\n", "[tenants.a]: unknown key 'burst'"),
    ("tenants = 3\n", "tenants must be a table"),
], ids=["syntax", "table", "weight", "negative", "fraction", "key", "shape"])
def test_a_bad_file_says_where_in_one_line(text: str, says: str) -> None:
    with pytest.raises(ConfigError) as exc:
        TenantPolicies.parse(text)
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_a_changed_file_is_read_again_and_a_broken_change_keeps_the_policy(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(GOOD)
    policy_file = PolicyFile(str(path))
    assert not policy_file.refresh()  # unchanged
    path.write_text(GOOD.replace("weight = 4.5", "weight = 9"))
    os.utime(path, ns=(1, 10**18))  # a new modification time even within the clock's resolution
    assert policy_file.refresh() and policy_file.policies.of("acme").weight == 9
    path.write_text("[tenants.acme]\nweight = -1\n")
    os.utime(path, ns=(1, 2 * 10**18))
    assert not policy_file.refresh()
    assert policy_file.policies.of("acme").weight == 9 and policy_file.errors == 1
    path.unlink()
    assert not policy_file.refresh() and policy_file.policies.of("acme").weight == 9


def test_a_file_that_does_not_validate_at_start_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text("[default]\nweight = 'heavy'\n")
    with pytest.raises(ConfigError, match="--tenant-policies"):
        PolicyFile(str(path))
    assert PolicyFile(None).policies == TenantPolicies()


def test_concurrency_counts_waiting_and_running_requests_until_they_end() -> None:
    usage = TenantUsage()
    policy = TenantPolicy(max_concurrency=2)
    for _ in range(2):
        assert usage.check("a", policy, 10, 0.0) is None
        usage.admitted("a", 10, 0.0)
    hit = usage.check("a", policy, 10, 0.0, mean_hold_s=0.7)
    assert hit is not None and hit.overload == common_pb2.OVERLOAD_TENANT_CONCURRENCY and hit.retry_after_s == 0.7
    assert usage.check("b", policy, 10, 0.0) is None  # another tenant: its own count
    usage.ended("a", 1.0)
    assert usage.check("a", policy, 10, 1.0) is None


@pytest.mark.parametrize(("share", "allowed"), [(1.0, 4), (0.5, 2), (0.1, 1)])
def test_each_router_enforces_its_share_of_a_limit(share: float, allowed: int) -> None:
    usage = TenantUsage()
    policy = TenantPolicy(max_concurrency=4)
    admitted = 0
    while usage.check("a", policy, 0, 0.0, share=share) is None:
        usage.admitted("a", 0, 0.0)
        admitted += 1
    assert admitted == allowed


def test_tokens_per_minute_refuse_until_old_charges_leave_the_window() -> None:
    usage = TenantUsage()
    policy = TenantPolicy(tokens_per_minute=100)
    usage.admitted("a", 60, 0.0)
    usage.ended("a", 0.5)
    usage.admitted("a", 30, 10.0)
    usage.ended("a", 10.5)
    hit = usage.check("a", policy, 20, 20.0)
    assert hit is not None and hit.overload == common_pb2.OVERLOAD_TENANT_TOKENS
    assert hit.retry_after_s == pytest.approx(WINDOW_S - 20.0)  # when the first 60 tokens leave
    assert usage.check("a", policy, 10, 20.0) is None
    assert usage.check("a", policy, 20, WINDOW_S + 0.1) is None
    too_big = usage.check("a", policy, 101, WINDOW_S + 0.1)
    assert too_big is not None and too_big.retry_after_s == WINDOW_S


def test_usage_forgets_tenants_with_nothing_in_flight_or_in_the_window() -> None:
    usage = TenantUsage()
    usage.admitted("a", 5, 0.0)
    usage.ended("a", 1.0)
    usage.check("a", TenantPolicy(), 0, WINDOW_S + 1)
    assert usage.in_flight("a") == 0 and not usage._by_tenant  # noqa: SLF001 - the bound is the point
