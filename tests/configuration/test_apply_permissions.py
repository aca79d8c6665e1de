"""`manage.py apply` grants run_agent per agent and view_runs on the tenant (issue #12, item 4)."""

from __future__ import annotations

import pytest

from agents.models import AgentDefinition
from agents.selectors import may_run_agent
from configuration.apply import apply_config
from tenants.models import Tenant, User
from tenants.permissions import may_view_all_runs
from tests.configuration.test_apply import SLUG, config, rejected

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fast_passwords(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def _config(run=("group:support-agents",), view_runs=("group:supervisors",)) -> dict:
    data = config()
    data["tenant"]["view_runs"] = list(view_runs)
    data["grants"].append({"agent": "helper", "run": list(run)})
    return data


def _who(perm) -> dict[str, bool]:
    agent = AgentDefinition.objects.get(tenant__slug=SLUG, name="helper")
    users = {u.username: User.objects.get(pk=u.pk) for u in User.objects.filter(tenant__slug=SLUG)}
    if perm == "run":
        return {name: may_run_agent(user, agent.pk) for name, user in users.items()}
    return {name: may_view_all_runs(user) for name, user in users.items()}


def test_it_grants_run_agent_and_view_runs_from_the_file():
    report = apply_config(_config())

    assert _who("run") == {"asha": True, "ravi": False}
    assert _who("view") == {"asha": False, "ravi": True}
    assert report.outcomes["grants"]["helper run_agent group:support-agents"] == "created"
    assert report.outcomes["grants"][f"{SLUG} view_runs group:supervisors"] == "created"
    again = apply_config(_config())
    assert not again.changed


def test_the_file_is_the_whole_list_of_who_may_run_an_agent():
    apply_config(_config())

    report = apply_config(_config(run=["user:ravi"], view_runs=[]))

    assert _who("run") == {"asha": False, "ravi": True}
    assert _who("view") == {"asha": False, "ravi": False}
    assert report.outcomes["grants"]["helper run_agent group:support-agents"] == "removed"


def test_grant_errors_name_their_path_and_nothing_is_applied():
    data = _config(run=["group:nobody"], view_runs=["someone"])
    data["grants"].append({"agent": "helper", "tool": "platform__echo"})
    data["grants"].append({"agent": "ghost", "use": ["user:asha"]})

    errors = rejected(data)

    assert ("tenant.view_runs[0]", 'must be "user:<username>" or "group:<name>"') in errors
    assert ("grants[2].run[0]", "no group named 'nobody'") in errors
    assert ("grants[3]", "give exactly one of tool (with use, approve) or agent (with run)") in errors
    assert ("grants[4].use", "only with tool") in errors
    assert not Tenant.objects.filter(slug=SLUG).exists()
