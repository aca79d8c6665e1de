"""Authority reaches the other regions by PostgreSQL logical replication (DESIGN.md section 9).

    publish()            at home: the publication of the authority tables and the heartbeat
    subscribe(conninfo)  in a region: the subscription to its home's publication
    unsubscribe()        in a region: drop it (the slot at home is dropped by the home's side)

What is written at home and only read elsewhere: people, groups and their members, the tenant
and its regions, object grants (django-guardian), kill switches, policy sets, and the home's
heartbeat. A region never writes these tables: every change is made at home and arrives here in
commit order, so the newest heartbeat a region holds vouches for every commit at home before
it (regions.models.authority_age). Logical replication was chosen over a custom feed because it
is the engine PostgreSQL ships: ordered, resumable from its slot after a cut, monitored by
pg_stat_subscription. The home needs wal_level = logical; the subscription connects as a role
with the REPLICATION attribute.
"""

from __future__ import annotations

from django.apps import apps
from django.db import connection

PUBLICATION = "authority"
SUBSCRIPTION = "authority_from_home"
AUTHORITY_MODELS = (
    "tenants.Tenant",
    "tenants.User",
    "tenants.TenantGroup",
    "auth.Group",
    "guardian.UserObjectPermission",
    "guardian.GroupObjectPermission",
    "runs.KillSwitch",
    "approvals.PolicySet",
    "approvals.TenantPolicies",
    "regions.TenantRegions",
    "regions.Heartbeat",
)


def authority_tables() -> list[str]:
    tables = [apps.get_model(label)._meta.db_table for label in AUTHORITY_MODELS]
    user = apps.get_model("tenants.User")
    tables.append(user.groups.through._meta.db_table)  # a user's groups
    return tables


def publish() -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"DROP PUBLICATION IF EXISTS {PUBLICATION}")
        cursor.execute(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE {', '.join(authority_tables())}")


def subscribe(conninfo: str, *, copy_data: bool = True) -> None:
    """Subscribe this region to its home (CREATE SUBSCRIPTION cannot run in a transaction)."""
    if connection.in_atomic_block:
        raise RuntimeError("CREATE SUBSCRIPTION cannot run inside a transaction")
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE SUBSCRIPTION {SUBSCRIPTION} CONNECTION %s PUBLICATION {PUBLICATION} "
            f"WITH (copy_data = {'true' if copy_data else 'false'})",
            [conninfo],
        )


def unsubscribe() -> None:
    """Drop the subscription without reaching the home (it may be cut off): its slot at home is
    then dropped there (SELECT pg_drop_replication_slot(...))."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_subscription WHERE subname = %s", [SUBSCRIPTION])
        if cursor.fetchone() is None:
            return
        cursor.execute(f"ALTER SUBSCRIPTION {SUBSCRIPTION} DISABLE")
        cursor.execute(f"ALTER SUBSCRIPTION {SUBSCRIPTION} SET (slot_name = NONE)")
        cursor.execute(f"DROP SUBSCRIPTION {SUBSCRIPTION}")


def lag_seconds() -> float | None:
    """How old this region's copy is by the home's heartbeat it holds, for the least fresh home."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT extract(epoch FROM now() - min(beat_at)) FROM {apps.get_model('regions.Heartbeat')._meta.db_table}"
        )
        row = cursor.fetchone()
    return float(row[0]) if row and row[0] is not None else None
