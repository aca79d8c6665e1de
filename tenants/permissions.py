"""Object permissions read fresh from django-guardian's tables, in one statement.

guardian's ObjectPermissionChecker caches per object and answers True for superusers; the
engine checks authority on every model turn and must see a revocation at once, for the run's
creator only. `holds` answers what guardian's get_objects_for_user(user, perm, klass=<that row>,
with_superuser=False, accept_global_perms=False) does, for one row: granted to the user or to one
of their groups (tools.offer does the same for use_tool over many tools at once).
"""

from __future__ import annotations

import functools

from django.contrib.auth import get_user_model
from django.db import connection

from agents.models import AgentDefinition
from tenants.models import Tenant


@functools.cache
def _sql(app_label: str, model: str, codename: str) -> str:
    from django.contrib.auth.models import Permission
    from django.contrib.contenttypes.models import ContentType
    from guardian.models import GroupObjectPermission, UserObjectPermission

    def table(m) -> str:
        return connection.ops.quote_name(m._meta.db_table)

    memberships = get_user_model().groups.through
    permission = (
        f"SELECT p.id FROM {table(Permission)} p JOIN {table(ContentType)} c ON c.id = p.content_type_id "
        f"WHERE c.app_label = '{app_label}' AND c.model = '{model}' AND p.codename = '{codename}'"
    )
    return (
        f"SELECT 1 FROM {table(UserObjectPermission)} WHERE user_id = %(user)s AND object_pk = %(pk)s "
        f"AND permission_id IN ({permission}) "
        f"UNION ALL SELECT 1 FROM {table(GroupObjectPermission)} g JOIN {table(memberships)} m "
        f"ON m.group_id = g.group_id WHERE m.user_id = %(user)s AND g.object_pk = %(pk)s "
        f"AND g.permission_id IN ({permission}) LIMIT 1"
    )


def holds(user, perm: str, obj_model, pk) -> bool:
    """Whether an active `user` holds `perm` (a codename of `obj_model`) on the row `pk` right now."""
    if user is None or not user.is_active or pk is None:
        return False
    meta = obj_model._meta
    with connection.cursor() as cursor:
        cursor.execute(_sql(meta.app_label, meta.model_name, perm), {"user": user.pk, "pk": str(pk)})
        return cursor.fetchone() is not None


def may_run_agent(user, agent_id) -> bool:
    return holds(user, "run_agent", AgentDefinition, agent_id)


def may_view_all_runs(user) -> bool:
    """Supervisors hold view_runs on their tenant; everyone else reads only the runs they started."""
    return user.tenant_id is not None and holds(user, "view_runs", Tenant, user.tenant_id)
