"""run_python's limits and prices in the configuration file (`sandbox`), capped per tenant: the
call's limits, its reservation (what the limits can cost) and its settlement (what it used)."""

from __future__ import annotations

import pytest

from configuration.apply import ConfigError, apply_config
from tenants.models import Tenant
from tests.configuration.test_apply import SLUG, config
from tools import run_python
from tools.models import SandboxCaps, Tool

pytestmark = pytest.mark.django_db

MiB = 1024 * 1024


@pytest.fixture(autouse=True)
def _fast_passwords(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def with_run_python(**fields) -> dict:
    data = config()
    data["tools"].append(
        {"server": "platform", "name": "run_python", "enabled": True, "effect": "read_only", **fields}
    )
    return data


def run_python_tool() -> Tool:
    return Tool.objects.get(tenant__slug=SLUG, remote_name="run_python")


def test_it_stores_the_tools_limits_and_prices_and_reserves_what_they_can_cost():
    sandbox = {
        "wall_seconds": 10,
        "cpu_seconds": 8,
        "memory_mib": 512,
        "processes": 16,
        "tmp_mib": 8,
        "output_mib": 4,
        "output_files": 5,
        "stdout_kib": 64,
        "prices": {"cpu_second": 0.0001, "gib_second": 0.00002},
    }
    apply_config(with_run_python(timeout_seconds=20, sandbox=sandbox))
    tool = run_python_tool()
    limits = run_python.limits_for(tool)
    assert limits == {
        "wall_seconds": 10,
        "cpu_seconds": 8,
        "cores": 1.0,
        "memory_bytes": 512 * MiB,
        "processes": 16,
        "tmp_bytes": 8 * MiB,
        "output_bytes": 4 * MiB,
        "output_files": 5,
        "stdout_bytes": 64 * 1024,
    }
    # 8 CPU s at 100 micros + 0.5 GiB for 10 s at 20 micros: the most one call can cost.
    assert tool.price_micros == 8 * 100 + 5 * 20 == run_python.reservation_micros(tool)
    # The settlement is what it used: 0.5 CPU s and 2.5 GiB-seconds, at the tool's prices.
    prices = run_python.prices_for(tool)
    assert run_python.cost_of({"cpu_seconds": 0.5, "gib_seconds": 2.5}, prices) == 50 + 50


def test_the_tenant_cap_and_the_deadline_hold_the_tools_limits():
    apply_config(with_run_python(timeout_seconds=12, sandbox={"wall_seconds": 60, "memory_mib": 4096}))
    tool = run_python_tool()
    assert run_python.limits_for(tool)["wall_seconds"] == 10  # its deadline less the margin
    SandboxCaps.objects.create(tenant=Tenant.objects.get(slug=SLUG), memory_bytes=256 * MiB, processes=8)
    limits = run_python.limits_for(tool)
    assert (limits["memory_bytes"], limits["processes"], limits["cpu_seconds"]) == (256 * MiB, 8, 10)


@pytest.mark.parametrize(
    "fields, path",
    [
        ({"sandbox": {"wall_seconds": 0}}, "tools[2].sandbox.wall_seconds"),
        ({"sandbox": {"memory_mib": 10**9}}, "tools[2].sandbox.memory_mib"),
        ({"sandbox": {"memory": 1}}, "tools[2].sandbox.memory"),
        ({"sandbox": {"prices": {"cpu_second": -1}}}, "tools[2].sandbox.prices.cpu_second"),
        ({"sandbox": {"prices": {"gpu_second": 1}}}, "tools[2].sandbox.prices.gpu_second"),
        ({"sandbox": {"prices": {"cpu_second": 0.001}}, "price": 0.0001}, "tools[2].price"),
    ],
)
def test_bad_sandbox_settings_are_refused_with_their_path(fields, path):
    with pytest.raises(ConfigError) as refused:
        apply_config(with_run_python(**fields))
    assert path in [p for p, _ in refused.value.errors], refused.value.errors
    assert not Tenant.objects.filter(slug=SLUG).exists()


def test_a_tool_that_runs_no_code_has_no_sandbox():
    data = config()
    data["tools"][0]["sandbox"] = {"wall_seconds": 5}
    with pytest.raises(ConfigError) as refused:
        apply_config(data)
    assert ("tools[0].sandbox", "only for run_python: this tool runs no code") in refused.value.errors
