"""use_tool_pks answers exactly what guardian's get_objects_for_user answers for use_tool.

The gateway reads guardian's tables itself (one UNION) because guardian's query costs ~10 ms of
CPU to build on every step; these cases pin the two to the same answer.
"""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Permission
from guardian.shortcuts import assign_perm, get_objects_for_user, remove_perm

from tests import factories
from tools import offer
from tools.models import Tool

pytestmark = pytest.mark.django_db


def guardian_pks(user, tools) -> set[str]:
    found = get_objects_for_user(
        user,
        "tools.use_tool",
        klass=Tool.objects.filter(pk__in=[t.pk for t in tools]),
        with_superuser=False,
        accept_global_perms=False,
    )
    return {str(pk) for pk in found.values_list("pk", flat=True)}


def test_it_matches_guardian_for_user_group_global_and_other_permissions(tenant, asha, ravi):
    tools = factories.make_builtin_tools(tenant)
    echo, noop, clock, sleep = tools["echo"], tools["noop"], tools["clock"], tools["sleep"]
    everything = list(tools.values())
    group = factories.make_group(tenant, "agents")
    ravi.groups.add(group)

    def same(user):
        mine = offer.use_tool_pks(user, [t.pk for t in everything])
        assert mine == guardian_pks(user, everything)
        return mine

    assert same(asha) == set()
    assign_perm("tools.use_tool", asha, echo)
    assign_perm("tools.approve_tool", asha, noop)  # another permission: not use_tool
    assign_perm("tools.use_tool", group, clock)  # asha is not in the group
    assert same(asha) == {str(echo.pk)}
    assert same(ravi) == {str(clock.pk)}
    asha.groups.add(group)
    assert same(asha) == {str(echo.pk), str(clock.pk)}
    asha.user_permissions.add(Permission.objects.get(codename="use_tool", content_type__app_label="tools"))
    assert same(asha) == {str(echo.pk), str(clock.pk)}  # a global permission counts for nothing
    asha.is_superuser = True
    asha.save()
    assert same(asha) == {str(echo.pk), str(clock.pk)}  # nor does being a superuser
    remove_perm("tools.use_tool", asha, echo)
    asha.groups.remove(group)
    assert same(asha) == set()
    assert offer.use_tool_pks(ravi, [sleep.pk]) == set()
    assert offer.use_tool_pks(ravi, []) == set()
    assert offer.has_use_tool(ravi, clock) and not offer.has_use_tool(ravi, sleep)
