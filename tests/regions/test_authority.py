"""Authority with a bounded reach (DESIGN.md section 9, docs/regions.md): grants are written at
the home (Mumbai) and reach this region (Frankfurt) by PostgreSQL logical replication, through
a link the test cuts, with the home's heartbeat. A tool call away from home needs a copy no
older than the tenant's revocation reach.

The home and this region hold the same tenant and user (the same ids: what replication of the
people would give; they are created on both sides so the subscription needs no initial copy).
The grant itself (django-guardian's row) is written and deleted only at home, as the admin does,
by SQL on the home's database. The region's day budget is given directly as a slice: the escrow
is tests/regions/test_escrow.py's business.
"""

from __future__ import annotations

import statistics
import threading
import time

import psycopg
import pytest
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.db import connection, transaction

from budgets import services as budgets
from regions import replication
from regions import services as regions
from regions.models import Heartbeat, TenantRegions
from runs.engine import advance
from runs.engine.decisions import AUTHORITY_STALE
from runs.models import TERMINAL, Run, Step
from runs.services import start_run
from tenants.models import User
from tests import factories
from tests.regions.conftest import AWAY, HOME
from tests.regions.link import Link
from tests.servers import wait_for
from tools.models import Tool

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.timeout(600)]

REACH = 2.0
TENANT_ID = USER_ID = 7001
RUNS = 20


def _home_sql(home, sql: str, params=()) -> float:
    """Run one statement at home, committed; the time it committed (as this machine's clock reads)."""
    with psycopg.connect(
        home.pg.url("home").replace("postgres://", "postgresql://", 1), autocommit=True
    ) as conn:
        conn.execute(sql, params)
        return time.time()


@pytest.fixture
def authority(home, settings):
    """Frankfurt subscribed to Mumbai's authority through a link; the home beating every 0.2 s."""
    settings.REGION_NAME = AWAY
    pg_link = Link(home.pg.port)
    beat = home.popen("beat", {"every": 0.2})
    tenant = factories.make_tenant("grants", pk=TENANT_ID)
    asha = User.objects.create_user(pk=USER_ID, username="asha-grants", password="pw", tenant=tenant)
    home.run(
        "people", {"tenant_id": TENANT_ID, "user_id": USER_ID, "slug": "grants", "username": asha.username}
    )
    home.run("publish", {})
    _same_content_types(home)
    replication.subscribe(
        f"host=127.0.0.1 port={pg_link.port} dbname=home user={home.pg.user}", copy_data=False
    )
    # After the subscription's slot exists: the next beat is an INSERT, which replication carries
    # (an UPDATE of a row the region never received would be skipped there).
    _home_sql(home, "DELETE FROM regions_heartbeat WHERE region = %s", [HOME])
    try:
        wait_for(
            lambda: Heartbeat.objects.filter(region=HOME).exists(), timeout=60, what="the home's heartbeat"
        )
        yield pg_link, tenant, asha
    finally:
        beat.kill()
        beat.wait(10)
        replication.unsubscribe()
        pg_link.close()
        deadline = time.monotonic() + 30
        while True:  # the walsender ends shortly after the subscription is gone
            try:
                _home_sql(
                    home,
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                    [replication.SUBSCRIPTION],
                )
                break
            except psycopg.errors.ObjectInUse:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        _home_sql(home, "DELETE FROM guardian_userobjectpermission WHERE user_id = %s", [USER_ID])


def _same_content_types(home) -> None:
    """Grants name their permission and model by id, so both regions must number them alike
    (docs/regions.md). Migrations do, but this test database renumbers them whenever a test
    flushes it: the home is given this region's numbering before each test."""
    types = list(ContentType.objects.values_list("id", "app_label", "model"))
    permissions = list(Permission.objects.values_list("id", "name", "content_type_id", "codename"))
    with psycopg.connect(home.pg.url("home").replace("postgres://", "postgresql://", 1)) as conn:
        conn.execute("TRUNCATE django_content_type, auth_permission CASCADE")
        with conn.cursor() as cursor:
            cursor.executemany(
                "INSERT INTO django_content_type (id, app_label, model) VALUES (%s, %s, %s)", types
            )
            cursor.executemany(
                "INSERT INTO auth_permission (id, name, content_type_id, codename) VALUES (%s, %s, %s, %s)",
                permissions,
            )


def _grant_row(tool: Tool) -> tuple:
    permission = Permission.objects.get(codename="use_tool", content_type__app_label="tools")
    return (permission.pk, ContentType.objects.get_for_model(Tool).pk, str(tool.pk), USER_ID)


# With an id of its own: this region's guardian rows (run_agent, given here by the test) come from
# the same sequence values as the home's, and replication would collide with them.
GRANT = (
    "INSERT INTO guardian_userobjectpermission (id, permission_id, content_type_id, object_pk, user_id) "
    "VALUES (7000000 + (SELECT count(*) FROM guardian_userobjectpermission), %s, %s, %s, %s)"
)
REVOKE = "DELETE FROM guardian_userobjectpermission WHERE permission_id = %s AND content_type_id = %s AND object_pk = %s AND user_id = %s"


def _granted_here(row) -> bool:
    with connection.cursor() as cursor:
        cursor.execute(REVOKE.replace("DELETE", "SELECT 1"), row)
        return cursor.fetchone() is not None


def _poll(predicate, *, timeout: float = 30) -> float:
    """When predicate() first held (time.time()), polling every 2 ms."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("not replicated in time")
        time.sleep(0.002)
    return time.time()


def _setup_runs(tenant, asha, home):
    echo = factories.make_builtin_tools(tenant)["echo"]
    factories.make_agent(
        tenant,
        tools=[echo],
        runners=[asha],
        expected_cost_micros=10_000,
        turns=[{"tool_calls": [{"name": echo.name, "arguments": {"n": 1}}]}, {"text": "done"}],
    )
    TenantRegions.objects.create(
        tenant=tenant, home=HOME, allowed=[HOME, AWAY], revocation_reach_seconds=REACH
    )
    with transaction.atomic():  # the day's slice, given directly (see the module docstring)
        budgets.move_day_limit(tenant, budgets.local_day(tenant), tenant.daily_budget_micros // 2)
    return echo


def _drive(runs: list, stop: threading.Event, *, pace: float) -> list[threading.Thread]:
    """Three workers, each taking one step of a run at a time, `pace` seconds apart."""

    def work(mine: list):
        try:
            while not stop.is_set():
                for run_id in mine:
                    if Run.objects.filter(pk=run_id).exclude(status__in=(*TERMINAL, "paused")).exists():
                        advance(run_id)
                        time.sleep(pace)
                time.sleep(0.01)
        finally:
            connection.close()

    threads = [threading.Thread(target=work, args=(runs[i::3],), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    return threads


def _calls_after(tool: Tool, moment: float) -> list[float]:
    """How long after `moment` each call of `tool` started in this region (dispatched), for those after it."""
    return sorted(
        s.dispatched_at.timestamp() - moment
        for s in Step.objects.filter(tool=tool, dispatched_at__isnull=False)
        if s.dispatched_at.timestamp() > moment
    )


def test_a_revoked_grant_reaches_the_region_within_the_bound_link_up_and_cut(home, authority):
    pg_link, tenant, asha = authority
    echo = _setup_runs(tenant, asha, home)
    row = _grant_row(echo)

    # The reach with the link up: revoke, see it gone here; grant again; 40 times.
    reaches = []
    for _ in range(40):
        _home_sql(home, GRANT, row)
        _poll(lambda: _granted_here(row))
        revoked = _home_sql(home, REVOKE, row)
        reaches.append(_poll(lambda: not _granted_here(row)) - revoked)
    p50, p99 = statistics.median(reaches), statistics.quantiles(reaches, n=100, method="inclusive")[98]
    print(
        f"revocation reach, link up, 40 revokes: p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, max {max(reaches) * 1000:.0f} ms"
    )
    assert p99 <= REACH

    # 20 runs about to call the tool, the grant revoked while they go: none calls later than the reach.
    _home_sql(home, GRANT, row)
    _poll(lambda: _granted_here(row))
    runs = [start_run(user=asha, agent="agent", input={"i": i})[0].pk for i in range(RUNS)]
    for run_id in runs:
        advance(run_id)  # the model proposes the call
    stop = threading.Event()
    workers = _drive(runs, stop, pace=0.05)
    time.sleep(0.3)
    revoked = _home_sql(home, REVOKE, row)
    wait_for(lambda: not Run.objects.filter(pk__in=runs).exclude(status__in=TERMINAL).exists(), timeout=120)
    stop.set()
    for t in workers:
        t.join(30)
    late = _calls_after(echo, revoked)
    called = Step.objects.filter(tool=echo, dispatched_at__isnull=False).count()
    print(
        f"link up: {called} of {RUNS} calls made, {len(late)} after the revoke, latest {max(late, default=0) * 1000:.0f} ms after"
    )
    assert not [d for d in late if d > REACH]
    assert Step.objects.filter(run_id__in=runs, status="denied").exists()  # the revoke was acted on

    # The link cut, then the revoke: the region acts on its copy until it is REACH old, then waits.
    _home_sql(home, GRANT, row)
    _poll(lambda: _granted_here(row))
    runs = [start_run(user=asha, agent="agent", input={"i": i})[0].pk for i in range(RUNS)]
    for run_id in runs:
        advance(run_id)
    pg_link.cut()
    revoked = _home_sql(home, REVOKE, row)
    stop = threading.Event()
    workers = _drive(runs, stop, pace=0.25)  # slower: the calls spread past the reach
    wait_for(
        lambda: not Run.objects.filter(pk__in=runs).exclude(status__in=(*TERMINAL, "paused")).exists(),
        timeout=120,
    )
    time.sleep(REACH)
    late = _calls_after(echo, revoked)
    paused = list(
        Run.objects.filter(pk__in=runs, status="paused", pause_reason=AUTHORITY_STALE).values_list(
            "pk", flat=True
        )
    )
    print(
        f"link cut: {len([d for d in late])} calls after the revoke (latest {max(late, default=0) * 1000:.0f} ms), {len(paused)} runs paused"
    )
    assert not [d for d in late if d > REACH]
    assert paused and _granted_here(row)  # the copy still says granted: waiting was the only safe answer
    pg_link.heal()
    _poll(lambda: not _granted_here(row), timeout=60)
    config = TenantRegions.objects.get(tenant=tenant)
    wait_for(
        lambda: (
            regions.resume_when_fresh(config.tenant) >= 0
            and not Run.objects.filter(pk__in=paused, status="paused").exists()
        ),
        timeout=30,
    )
    wait_for(lambda: not Run.objects.filter(pk__in=runs).exclude(status__in=TERMINAL).exists(), timeout=120)
    stop.set()
    for t in workers:
        t.join(30)
    assert not [d for d in _calls_after(echo, revoked) if d > REACH]
    assert set(Step.objects.filter(run_id__in=paused, kind="tool").values_list("status", flat=True)) == {
        "denied"
    }


def test_a_run_start_away_from_home_is_refused_on_a_stale_copy(home, authority):
    pg_link, tenant, asha = authority
    _setup_runs(tenant, asha, home)
    assert start_run(user=asha, agent="agent", input={})[0]
    pg_link.cut()
    wait_for(lambda: regions_stale(tenant), timeout=30, what="the copy to age past the reach")
    with pytest.raises(Exception) as refused:
        start_run(user=asha, agent="agent", input={"again": 1})
    assert getattr(refused.value, "code", "") == "authority_stale" and refused.value.status == 503
    pg_link.heal()
    wait_for(lambda: not regions_stale(tenant), timeout=60, what="the copy fresh again")
    assert start_run(user=asha, agent="agent", input={"again": 2})[0]


def regions_stale(tenant) -> bool:
    from runs.authority_copy import stale_authority

    return stale_authority(tenant.pk) is not None


KILL = (
    'INSERT INTO runs_killswitch (id, scope, tenant_id, target_id, target_name, "on", reason, changed_at) '
    "VALUES (7000001, 'tool', %s, %s, %s, true, 'stop the echo tool everywhere', now())"
)


def test_a_kill_switch_flipped_at_home_stops_calls_in_the_region_within_the_bound(home, authority):
    pg_link, tenant, asha = authority
    echo = _setup_runs(tenant, asha, home)
    row = _grant_row(echo)
    _home_sql(home, GRANT, row)
    _poll(lambda: _granted_here(row))
    runs = [start_run(user=asha, agent="agent", input={"i": i})[0].pk for i in range(RUNS)]
    for run_id in runs:
        advance(run_id)  # the model proposes the call
    stop = threading.Event()
    workers = _drive(runs, stop, pace=0.1)
    time.sleep(0.3)
    try:
        killed = _home_sql(home, KILL, [TENANT_ID, echo.pk, echo.name])
        seen = _poll(lambda: _switch_here(echo), timeout=30)
        wait_for(
            lambda: not Run.objects.filter(pk__in=runs).exclude(status__in=(*TERMINAL, "paused")).exists(),
            timeout=120,
        )
    finally:
        stop.set()
        for t in workers:
            t.join(30)
        _home_sql(home, "DELETE FROM runs_killswitch WHERE id = 7000001")
    late = _calls_after(echo, killed)
    by_switch = Run.objects.filter(pk__in=runs, status="paused", paused_by_switch__isnull=False).count()
    print(
        f"kill switch, link up: reached the region {(seen - killed) * 1000:.0f} ms after its commit; "
        f"{len(late)} calls after it (latest {max(late, default=0) * 1000:.0f} ms), {by_switch} runs paused by it"
    )
    assert not [d for d in late if d > REACH]
    assert by_switch > 0


def _switch_here(tool: Tool) -> bool:
    with connection.cursor() as cursor:
        cursor.execute('SELECT 1 FROM runs_killswitch WHERE target_id = %s AND "on"', [tool.pk])
        return cursor.fetchone() is not None
