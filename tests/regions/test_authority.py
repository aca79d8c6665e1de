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
from regions.models import Heartbeat, HomeAnswer, TenantRegions
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
        # Every table of the subscription past its initial synchronisation: a change to a table
        # still being synchronised waits for it (tens of seconds on a loaded machine), which
        # would be measured as reach.
        wait_for(_all_tables_ready, timeout=120, what="the subscription's tables ready")
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
        _home_sql(home, "DELETE FROM approvals_policyset WHERE tenant_id = %s", [TENANT_ID])
        _home_sql(home, "DELETE FROM approvals_tenantpolicies WHERE tenant_id = %s", [TENANT_ID])
        _home_sql(home, "DELETE FROM regions_tenantregions WHERE tenant_id = %s", [TENANT_ID])


def _all_tables_ready() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_subscription_rel WHERE srsubstate <> 'r'")
        return cursor.fetchone()[0] == 0


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


def _regions_written_at_home(home, tenant) -> None:
    """The home answers only for a tenant whose home it is: the tenant's regions written there and
    replicated here, as in production (not given here directly, as _setup_runs does)."""
    TenantRegions.objects.filter(tenant=tenant).delete()
    _home_sql(
        home,
        "INSERT INTO regions_tenantregions (id, tenant_id, home, allowed, slice_micros, away_share_percent, "
        "revocation_reach_seconds) VALUES (7000002, %s, %s, %s, 0, 50, %s)",
        [TENANT_ID, HOME, f'["{HOME}", "{AWAY}"]', REACH],
    )
    _poll(lambda: TenantRegions.objects.filter(tenant=tenant).exists())


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


def _policy_version_here() -> int | None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT version FROM approvals_tenantpolicies WHERE tenant_id = %s", [TENANT_ID])
        row = cursor.fetchone()
    return row[0] if row else None


def _home_policy(home, text: str | None) -> dict:
    """The tenant's one policy set changed at home as `apply` changes it: the set and the tenant's
    policy version in one commit. When it committed (time.time()) and the new version."""
    with psycopg.connect(home.pg.url("home").replace("postgres://", "postgresql://", 1)) as conn:
        if text is None:
            conn.execute("DELETE FROM approvals_policyset WHERE tenant_id = %s", [TENANT_ID])
        else:
            conn.execute(
                "INSERT INTO approvals_policyset (tenant_id, name, mode, text, source, first_line, private) "
                "VALUES (%s, 'regions-test', 'enforce', %s, '', 1, false) "
                "ON CONFLICT (tenant_id, name) DO UPDATE SET text = EXCLUDED.text",
                [TENANT_ID, text],
            )
        [version] = conn.execute(
            "UPDATE approvals_tenantpolicies SET version = version + 1 WHERE tenant_id = %s RETURNING version",
            [TENANT_ID],
        ).fetchone()
        conn.commit()
        return {"committed_at": time.time(), "version": version}


def _forbid(tool: Tool) -> str:
    return f'@id("no-echo-anywhere")\nforbid (principal, action == Action::"{tool.name}", resource);'


def _denied_by_policy(runs: list) -> int:
    return sum(
        1
        for step in Step.objects.filter(run_id__in=runs, kind="tool", status="denied")
        if "no-echo-anywhere" in f"{step.error} {step.result} {step.observation}"
    )


def test_a_policy_changed_at_home_reaches_the_region_within_the_bound_and_a_stale_copy_waits(home, authority):
    """A Cedar policy set written at home (as `apply` writes it: the set and the tenant's policy
    version in one commit) forbids the tool: with the link up it reaches the region within the
    reach and calls are denied by it; with the link cut, the region calls on its copy only while
    that copy is younger than the reach, then waits, and the waiting calls are denied by the
    policy once the copy is fresh again."""
    pg_link, tenant, asha = authority
    echo = _setup_runs(tenant, asha, home)
    row = _grant_row(echo)
    _home_sql(home, GRANT, row)
    home.run("policy", {"tenant_id": TENANT_ID, "text": None})  # the tenant's policies, none forbidding
    _poll(lambda: _granted_here(row) and _policy_version_here() is not None)

    # Link up: 20 runs about to call the tool, the forbid written at home while they go.
    runs = [start_run(user=asha, agent="agent", input={"i": i})[0].pk for i in range(RUNS)]
    for run_id in runs:
        advance(run_id)  # the model proposes the call
    stop = threading.Event()
    workers = _drive(runs, stop, pace=0.05)
    time.sleep(0.3)
    changed = _home_policy(home, _forbid(echo))
    seen = _poll(lambda: _policy_version_here() == changed["version"])
    wait_for(lambda: not Run.objects.filter(pk__in=runs).exclude(status__in=TERMINAL).exists(), timeout=120)
    stop.set()
    for t in workers:
        t.join(30)
    late = _calls_after(echo, changed["committed_at"])
    print(
        f"policy change, link up: reached the region {(seen - changed['committed_at']) * 1000:.0f} ms after "
        f"its commit; {len(late)} calls after it (latest {max(late, default=0) * 1000:.0f} ms), "
        f"{_denied_by_policy(runs)} calls denied by it"
    )
    assert seen - changed["committed_at"] <= REACH
    assert not [d for d in late if d > REACH]
    assert _denied_by_policy(runs) > 0  # the new policy was acted on here

    # Link cut, then the policy changed back to permit and again to forbid at home: the region
    # acts on its copy (still forbidding) until it is REACH old, then calls wait.
    permitted = _home_policy(home, None)
    _poll(lambda: _policy_version_here() == permitted["version"])
    runs = [start_run(user=asha, agent="agent", input={"i": i})[0].pk for i in range(RUNS)]
    for run_id in runs:
        advance(run_id)
    pg_link.cut()
    changed = _home_policy(home, _forbid(echo))
    stop = threading.Event()
    workers = _drive(runs, stop, pace=0.25)
    wait_for(
        lambda: not Run.objects.filter(pk__in=runs).exclude(status__in=(*TERMINAL, "paused")).exists(),
        timeout=120,
    )
    time.sleep(REACH)
    late = _calls_after(echo, changed["committed_at"])
    paused = list(
        Run.objects.filter(pk__in=runs, status="paused", pause_reason=AUTHORITY_STALE).values_list(
            "pk", flat=True
        )
    )
    print(
        f"policy change, link cut: {len(late)} calls after it on the old copy (latest "
        f"{max(late, default=0) * 1000:.0f} ms), {len(paused)} runs waiting on the stale copy"
    )
    assert not [d for d in late if d > REACH]
    assert paused and _policy_version_here() == permitted["version"]  # the copy still permits
    pg_link.heal()
    _poll(lambda: _policy_version_here() == changed["version"], timeout=60)
    wait_for(
        lambda: (
            regions.resume_when_fresh(tenant) >= 0
            and not Run.objects.filter(pk__in=paused, status="paused").exists()
        ),
        timeout=30,
    )
    wait_for(lambda: not Run.objects.filter(pk__in=runs).exclude(status__in=TERMINAL).exists(), timeout=120)
    stop.set()
    for t in workers:
        t.join(30)
    assert not [d for d in _calls_after(echo, changed["committed_at"]) if d > REACH]
    assert _denied_by_policy(paused) == len(paused)  # every waiting call was judged on the new policy


def _keep(tenant, stop: threading.Event) -> threading.Thread:
    """The keeper's authority pass (what beat runs every REGION_TEND_SECONDS)."""

    def keep():
        try:
            while not stop.is_set():
                regions.resume_when_fresh(tenant)
                time.sleep(0.2)
        finally:
            connection.close()

    thread = threading.Thread(target=keep, daemon=True)
    thread.start()
    return thread


def test_on_a_stale_copy_the_region_asks_the_home_for_the_call_and_waits_when_it_cannot(
    home, link, authority
):
    """Replication cut (the copy ages past the reach) but the signed link up: the region asks
    the home about each waiting call and acts on its answer (granted: called; revoked at home
    while the copy here still says granted: denied). Both links cut: the calls wait, and are
    judged on the fresh copy once it returns."""
    pg_link, tenant, asha = authority
    echo = _setup_runs(tenant, asha, home)
    _regions_written_at_home(home, tenant)
    row = _grant_row(echo)
    _home_sql(home, GRANT, row)
    _poll(lambda: _granted_here(row))
    runs = [start_run(user=asha, agent="agent", input={"i": i})[0].pk for i in range(15)]
    for run_id in runs:
        advance(run_id)  # the model proposes the call
    granted, revoked, cut_off = runs[:5], runs[5:10], runs[10:]
    pg_link.cut()
    wait_for(lambda: regions_stale(tenant), timeout=30, what="the copy to age past the reach")
    stop = threading.Event()
    keeper = _keep(tenant, stop)
    workers = _drive(granted, stop, pace=0.05)
    try:
        wait_for(
            lambda: not Run.objects.filter(pk__in=granted).exclude(status__in=TERMINAL).exists(), timeout=120
        )
        assert regions_stale(tenant)  # the calls were made on the home's answers, not on a fresh copy
        assert set(Step.objects.filter(run_id__in=granted, kind="tool").values_list("status", flat=True)) == {
            "succeeded"
        }
        assert HomeAnswer.objects.filter(run_id__in=granted, verdict="act").count() == len(granted)

        revoked_at = _home_sql(home, REVOKE, row)  # at home only: the copy here still says granted
        workers += _drive(revoked, stop, pace=0.05)
        wait_for(
            lambda: not Run.objects.filter(pk__in=revoked).exclude(status__in=TERMINAL).exists(), timeout=120
        )
        assert _granted_here(row) and regions_stale(tenant)
        denied = Step.objects.filter(run_id__in=revoked, kind="tool", status="denied")
        assert denied.count() == len(revoked)
        assert all("not held at the home region" in f"{s.error} {s.observation}" for s in denied)
        assert not _calls_after(echo, revoked_at)

        link.cut()  # and the signed link: nobody to ask; the calls wait
        workers += _drive(cut_off, stop, pace=0.05)
        wait_for(
            lambda: (
                Run.objects.filter(pk__in=cut_off, status="paused", pause_reason=AUTHORITY_STALE).count()
                == len(cut_off)
            ),
            timeout=60,
        )
        time.sleep(2 * REACH)  # passes of the keeper find the home unreachable: still waiting
        assert Run.objects.filter(pk__in=cut_off, status="paused").count() == len(cut_off)
        assert not HomeAnswer.objects.filter(run_id__in=cut_off).exists()
        assert not _calls_after(echo, revoked_at)
        link.heal()
        pg_link.heal()
        wait_for(
            lambda: not Run.objects.filter(pk__in=cut_off).exclude(status__in=TERMINAL).exists(), timeout=120
        )
    finally:
        stop.set()
        for t in [keeper, *workers]:
            t.join(30)
    assert set(Step.objects.filter(run_id__in=cut_off, kind="tool").values_list("status", flat=True)) == {
        "denied"
    }
    assert not _calls_after(echo, revoked_at)


def test_on_a_stale_copy_a_run_start_asks_the_home_and_waits_when_it_cannot(home, link, authority):
    """Replication cut (the copy ages past the reach) but the signed link up: a run start asks
    the home whether the user may run the agent now and is refused as the home says (run_agent
    revoked there, an agent's switch on there), though the copy here still allows it; both links
    cut: 503 with Retry-After, and no run."""
    from agents.models import AgentDefinition
    from core.errors import DomainError, Forbidden

    pg_link, tenant, asha = authority
    _setup_runs(tenant, asha, home)
    _regions_written_at_home(home, tenant)
    agent = AgentDefinition.objects.get(tenant=tenant, name="agent")
    pg_link.cut()
    wait_for(lambda: regions_stale(tenant), timeout=30, what="the copy to age past the reach")
    # run_agent written at home while the copy is cut off (this region holds the test's own row).
    permission = Permission.objects.get(codename="run_agent", content_type__app_label="agents")
    row = (permission.pk, ContentType.objects.get_for_model(AgentDefinition).pk, str(agent.pk), USER_ID)
    _home_sql(home, GRANT, row)
    started, _ = start_run(user=asha, agent="agent", input={"i": 1})
    assert started.status == "queued" and regions_stale(tenant)  # on the home's answer

    _home_sql(home, REVOKE, row)  # at home only: the copy here still says granted
    with pytest.raises(Forbidden) as refused:
        start_run(user=asha, agent="agent", input={"i": 2})
    assert refused.value.code == "not_permitted" and "at the home region" in refused.value.message

    _home_sql(home, GRANT, row)
    _home_sql(
        home,
        'INSERT INTO runs_killswitch (id, scope, tenant_id, target_id, target_name, "on", reason, changed_at) '
        "VALUES (7000003, 'agent', %s, %s, 'agent', true, 'agent retired', now())",
        [TENANT_ID, agent.pk],
    )
    with pytest.raises(DomainError) as switched:
        start_run(user=asha, agent="agent", input={"i": 3})
    assert switched.value.status == 423 and "agent retired" in switched.value.message
    _home_sql(home, "DELETE FROM runs_killswitch WHERE id = 7000003")

    link.cut()  # and the signed link: nobody to ask
    with pytest.raises(DomainError) as waiting:
        start_run(user=asha, agent="agent", input={"i": 4})
    assert waiting.value.status == 503 and waiting.value.code == "authority_stale"
    assert "could not be asked" in waiting.value.message
    assert Run.objects.filter(tenant=tenant).count() == 1
    link.heal()
