"""Object permissions read fresh from django-guardian's tables, in one statement.

guardian's ObjectPermissionChecker caches per object and answers True for superusers; the
engine checks authority on every model turn and must see a revocation at once, for the run's
creator only. `holds` answers what guardian's get_objects_for_user(user, perm, klass=<that row>,
with_superuser=False, accept_global_perms=False) does, for one row: granted to the user or to one
of their groups; `held_pks` for every row of a model; `held_sql` is the one statement behind both,
and behind tools.offer's use_tool filter over many tools at once. Nothing else reads guardian's
permission tables (guardian's API still writes them: assign_perm, remove_perm).
"""

from __future__ import annotations

import functools

from django.contrib.auth import get_user_model
from django.db import connection

from tenants.models import Tenant


@functools.cache
def held_sql(app_label: str, model: str, codename: str, *, column: str) -> str:
    """SQL that is true when user %(user)s holds `codename` on the row whose id is `column` (an
    SQL expression: a column of the caller's query, or a parameter), directly or through a group.

    The one hand-written form of guardian's get_objects_for_user(user, perm, klass=...,
    with_superuser=False, accept_global_perms=False): a small UNION over guardian's two tables
    instead of guardian's nested subqueries (~10 ms of CPU to build with the ORM, on every step).
    """
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
        f"CAST({column} AS TEXT) IN (SELECT object_pk FROM {table(UserObjectPermission)} "
        f"WHERE user_id = %(user)s AND permission_id IN ({permission}) "
        f"UNION ALL SELECT g.object_pk FROM {table(GroupObjectPermission)} g "
        f"JOIN {table(memberships)} m ON m.group_id = g.group_id "
        f"WHERE m.user_id = %(user)s AND g.permission_id IN ({permission}))"
    )


def holds(user, perm: str, obj_model, pk) -> bool:
    """Whether an active `user` holds `perm` (a codename of `obj_model`) on the row `pk` right now."""
    if user is None or not user.is_active or pk is None:
        return False
    meta = obj_model._meta
    predicate = held_sql(meta.app_label, meta.model_name, perm, column="%(pk)s")
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT 1 WHERE {predicate}", {"user": user.pk, "pk": str(pk)})
        return cursor.fetchone() is not None


def held_pks(user, perm: str, obj_model) -> list[str]:
    """The pks (as text) of the `obj_model` rows on which an active `user` holds `perm` right now."""
    if user is None or not user.is_active:
        return []
    meta = obj_model._meta
    table = connection.ops.quote_name(meta.db_table)
    predicate = held_sql(meta.app_label, meta.model_name, perm, column="o.id")
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT o.id FROM {table} o WHERE {predicate}", {"user": user.pk})
        return [str(pk) for (pk,) in cursor.fetchall()]


def may_view_all_runs(user) -> bool:
    """Supervisors hold view_runs on their tenant; everyone else reads only the runs they started."""
    return user.tenant_id is not None and holds(user, "view_runs", Tenant, user.tenant_id)
