"""A region's worker killed mid-step (DESIGN.md sections 5 and 9): the usual recovery holds inside
the region, nothing is spent twice or beyond the slice, and the home does not lend the region's
slice to anyone else while it is out; both ledgers reconcile to the micro.

Frankfurt (this process's database) runs real Celery worker processes configured as Frankfurt;
Mumbai, the home, is the second cluster with its API behind the link (tests/regions/conftest.py).
The tool is an idempotent refund at the fake bank: the worker is SIGKILLed after the bank applied
it and before the answer was recorded. The killed attempt's reservation stays held in the region,
counting, until a supervisor resolves it (unknown charges stay held where they arose).
"""

from __future__ import annotations

import pytest
from django.utils import timezone

from budgets import services as budgets
from budgets.models import Reservation
from regions import services as regions
from regions.models import Heartbeat, SliceRequest, TenantRegions
from regions.selectors import region_books
from runs.models import Step
from runs.recovery import sweeper
from runs.services import start_run
from tests import factories
from tests.recovery.conftest import FAST_LEASES, REFUND, run_of, single_call_agent, step_of
from tests.regions import race
from tests.regions.conftest import AWAY, HOME, KEY
from tests.servers import wait_for
from tools.models import Tool

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.slow,
    pytest.mark.timeout(600),
]

ZONE = "Asia/Kolkata"


def test_a_worker_killed_mid_step_away_from_home_recovers_in_the_region_and_the_ledgers_reconcile(
    home, link, bank, workers
):
    tenant = factories.make_tenant("killed", time_zone=ZONE, max_active_runs=50, max_starts_per_minute=50)
    asha = factories.make_user(tenant, "asha-killed")
    per_call = race.make_racing_agent(tenant, asha, factories)  # the home prices the day the same
    tenant.daily_budget_micros = 40 * per_call
    tenant.save()
    refund = factories.make_bank_tools(tenant, bank.mcp_url)["issue_refund"]
    Tool.objects.filter(pk=refund.pk).update(timeout_seconds=5, effect_class="idempotent", price_micros=900)
    single_call_agent(tenant, asha, refund, REFUND, name="refunder", final="refunded")
    config = TenantRegions.objects.create(
        tenant=tenant,
        home=HOME,
        allowed=[HOME, AWAY],
        slice_micros=6 * per_call,
        revocation_reach_seconds=86_400,  # authority's reach is test_authority.py's business
    )
    Heartbeat.objects.update_or_create(region=HOME, defaults={"beat_at": timezone.now()})
    home.run(
        "setup",
        {"slug": tenant.slug, "daily": tenant.daily_budget_micros, "slice": config.slice_micros, "zone": ZONE,
         "regions": [HOME, AWAY]},
    )  # fmt: skip
    day = budgets.local_day(tenant)
    wait_for(
        lambda: (regions.tend(config), budgets.tenant_day_account(tenant, day).limit_micros)[1] > 0,
        timeout=60,
        interval=1,
        what="a slice from the home",
    )
    lent_before = home.run("books", {"slug": tenant.slug, "day": day.isoformat()})["lent"][AWAY]

    as_frankfurt = {
        **FAST_LEASES,
        "REGION": AWAY,
        "REGION_PEERS": f"{HOME}={link.url}",
        "REGION_KEYS": f"{HOME}={KEY}",
    }
    bank.fault(tool="issue_refund", delay_after_effect=30)
    w1 = workers("w1", env=as_frankfurt)
    run, _ = start_run(user=asha, agent="refunder", input={})
    effect = wait_for(lambda: bank.effects("issue_refund"), timeout=60, interval=0.05, what="refund applied")[
        0
    ]
    w1.kill()

    # The worker is gone with the call's answer: its reservation is still open in the slice, and
    # the home still counts the whole slice as lent (it lends it to no one else meanwhile).
    assert Reservation.objects.filter(run_id=run.pk, status="open").exists()
    at_home = home.run("books", {"slug": tenant.slug, "day": day.isoformat()})
    assert at_home["check"] == {} and at_home["lent"][AWAY] == lent_before

    workers("w2", env=as_frankfurt)
    run_id = run.pk

    def recovered():
        sweeper.sweep()  # what beat does: the dead worker's lease expires, the run is sent again
        found = run_of(run_id)
        return found if found.is_terminal else None

    run = wait_for(recovered, timeout=180, interval=0.5, what="the run recovered in the region")
    assert run.status == "succeeded", run.error
    step = step_of(run.pk, 2)
    assert (step.status, step.attempts, step.crashes) == ("succeeded", 2, 1)
    effects = bank.effects("issue_refund")
    assert len(effects) == 1 and effects[0]["idempotency_key"] == step.idempotency_key  # refunded once
    assert step.result["structured"]["refund_id"] == effect["result"]["refund_id"]

    # The killed attempt's reservation is held where it arose (DESIGN.md section 9: unknown
    # charges stay held, and count, until resolved): attempt 2 reserved and settled its own.
    held = Reservation.objects.get(tenant=tenant, status="held")
    assert (held.step_id, held.amount_micros) == (step.pk, 900)
    assert budgets.tenant_day_account(tenant, day).held_micros == 900
    # A supervisor resolves it: the bank applied the refund once, and attempt 2 paid for it.
    supervisor = factories.make_user(tenant, "sara-killed")
    assert budgets.write_off(held.pk, actor=supervisor, note="refund applied once; attempt 2 was charged")

    # Both ledgers to the micro: nothing reserved or held, the region spent exactly its steps'
    # costs within its slice, and what the home lent is the region's limit.
    wait_for(
        lambda: (regions.tend(config), not SliceRequest.objects.filter(status="pending").exists())[1],
        timeout=30,
        what="no request pending",
    )
    assert not Reservation.objects.filter(tenant=tenant, status__in=("open", "held")).exists()
    assert region_books(tenant, day) == {}
    account = budgets.tenant_day_account(tenant, day)
    costs = sum(Step.objects.filter(run__tenant=tenant).values_list("cost_micros", flat=True))
    assert account.spent_micros == costs > 0
    assert (account.reserved_micros, account.held_micros) == (0, 0)
    assert account.spent_micros <= account.limit_micros
    at_home = home.run("books", {"slug": tenant.slug, "day": day.isoformat()})
    lent = at_home["lent"][AWAY]
    assert at_home["check"] == {}
    assert lent["granted"] - lent["returned"] == account.limit_micros
    assert at_home["days"][day.isoformat()]["limit"] + account.limit_micros == tenant.daily_budget_micros
