"""`roles:` on users and groups: apply grants exactly the roles' model permissions (tenants/roles.py)."""

from __future__ import annotations

import pytest

from configuration.apply import apply_config
from tenants.models import Tenant, User
from tenants.permissions import may_view_all_runs
from tenants.roles import ROLES
from tests.configuration.test_apply import SLUG, config, rejected

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fast_passwords(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def with_roles(*, supervisors=("supervisor",), ravi=None, asha=None) -> dict:
    data = config()
    data["groups"] = [{"name": "support-agents"}, {"name": "supervisors", "roles": list(supervisors)}]
    if ravi is not None:
        data["users"][1]["roles"] = list(ravi)
    if asha is not None:
        data["users"][0]["roles"] = list(asha)
    return data


def perms(username: str) -> set[str]:
    """What Django answers now, through the user's own and their groups' permissions."""
    user = User.objects.get(username=username)
    return {p for p in user.get_all_permissions() if not p.endswith(("use_tool", "approve_tool"))}


def test_a_group_role_gives_its_members_exactly_the_roles_permissions_and_the_admin():
    apply_config(with_roles())

    assert perms("ravi") == set(ROLES["supervisor"])
    assert User.objects.get(username="ravi").is_staff
    assert perms("asha") == set()


def test_a_user_role_adds_to_the_roles_of_their_groups_and_makes_them_staff():
    data = with_roles(asha=["support"])
    del data["users"][1]["staff"]

    apply_config(data)

    asha, ravi = User.objects.get(username="asha"), User.objects.get(username="ravi")
    assert asha.is_staff and ravi.is_staff
    assert perms("asha") == set(ROLES["support"])


def test_a_removed_role_takes_its_permissions_away():
    apply_config(with_roles(supervisors=["supervisor", "operator"], asha=["operator"]))
    assert "tools.change_tool" in perms("ravi") and "tools.change_tool" in perms("asha")

    report = apply_config(with_roles(supervisors=["supervisor"], asha=["support"]))

    assert perms("ravi") == set(ROLES["supervisor"])
    assert perms("asha") == set(ROLES["support"])
    assert "updated groups supervisors (roles)" in report.changes
    assert "updated users asha (roles)" in report.changes


def test_roles_are_idempotent():
    apply_config(with_roles(asha=["support"]))

    assert not apply_config(with_roles(asha=["support"])).changed


def test_the_supervisor_role_reads_every_run_of_the_tenant_and_losing_it_ends_that():
    apply_config(with_roles(asha=["supervisor"]))
    tenant = Tenant.objects.get(slug=SLUG)
    assert may_view_all_runs(User.objects.get(username="ravi"))
    assert may_view_all_runs(User.objects.get(username="asha"))

    apply_config(with_roles(supervisors=["support"], asha=["support"]))

    assert not may_view_all_runs(User.objects.get(username="ravi"))
    assert not may_view_all_runs(User.objects.get(username="asha"))
    assert User.objects.get(username="ravi").tenant == tenant


def test_tenant_view_runs_and_the_supervisor_role_add_up():
    data = with_roles(supervisors=["support"])
    data["tenant"]["view_runs"] = ["user:asha"]

    apply_config(data)

    assert may_view_all_runs(User.objects.get(username="asha"))
    assert not may_view_all_runs(User.objects.get(username="ravi"))


def test_an_unknown_role_and_a_role_without_the_admin_are_errors_at_their_path():
    data = with_roles(supervisors=["supervisor", "auditor"], asha=["support"])
    data["users"][0]["staff"] = False

    assert rejected(data) == [
        ("groups[1].roles[1]", "must be one of supervisor, support, operator"),
        ("users[0].staff", "a user with roles works in the admin: leave staff out or set it true"),
    ]
    assert not User.objects.filter(username="asha").exists()
