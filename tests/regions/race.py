"""Runs racing on one tenant in one region: started through start_run, driven by worker threads
calling runs.engine.advance (what Celery workers do), admitted by the sweeper's admission pass
and, away from home, fed by the slice keeper (what beat does). Used in the pytest process (the
non-home region) and in tests/regions/home_side.py (the home region's process)."""

from __future__ import annotations

import threading
import time

from django.db import connection
from django.db.models import Sum
from django.utils import timezone

from budgets.models import Reservation
from llm import gateway
from regions import services as regions
from regions.models import HomeLink
from runs import admission
from runs.engine import advance
from runs.models import TERMINAL, Run, RunStatus, Step
from runs.recovery import sweeper
from runs.services import start_run
from tools import offer

ACTIVE = (RunStatus.QUEUED, RunStatus.RUNNING)


def per_call_micros(tenant, user, version) -> int:
    run = Run(
        tenant=tenant, created_by=user, version=version, input={"i": 0}, limits={"max_output_tokens": 200}
    )
    return gateway.estimate_cost_micros(
        version.model_endpoint, gateway.build_request(run, [], offer.offered_tools(run))
    )


def make_racing_agent(tenant, user, factories, *, tool_price: int = 700):
    """A run: two echo calls then an answer (three model calls, two tool calls)."""
    tools = factories.make_builtin_tools(tenant)
    echo = tools["echo"]
    echo.price_micros = tool_price
    echo.save()
    factories.grant(echo, use=[user])
    probe = factories.make_agent(tenant, name="probe", tools=[echo], limits={"max_output_tokens": 200})
    per_call = per_call_micros(tenant, user, probe)
    factories.make_agent(
        tenant,
        tools=[echo],
        limits={"max_output_tokens": 200},
        expected_cost_micros=4 * per_call + 2 * tool_price,
        turns=[
            {"tool_calls": [{"name": echo.name, "arguments": {"n": 1}}]},
            {"tool_calls": [{"name": echo.name, "arguments": {"n": 2}}]},
            {"text": "done"},
        ],
    )
    return per_call


class Race:
    """Start `runs` runs at once and drive them with `workers` threads until stop()."""

    def __init__(self, tenant, user, *, runs: int, workers: int = 3, keeper=None, tick: float = 0.1):
        self.tenant, self.user, self.count = tenant, user, runs
        self.keeper, self.tick = keeper, tick
        self.ids: list = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, daemon=True) for _ in range(workers)]
        self._threads.append(threading.Thread(target=self._keep, daemon=True))

    def start(self) -> Race:
        barrier = threading.Barrier(self.count)
        ids: list = [None] * self.count

        def begin(i: int) -> None:
            try:
                barrier.wait()
                ids[i] = start_run(user=self.user, agent="agent", input={"i": i}, wait=True)[0].pk
            except BaseException as exc:
                self.errors.append(exc)
            finally:
                connection.close()

        starters = [threading.Thread(target=begin, args=(i,)) for i in range(self.count)]
        for t in starters:
            t.start()
        for t in starters:
            t.join(120)
        self.ids = [i for i in ids if i is not None]
        for t in self._threads:
            t.start()
        return self

    def _guard(self, body) -> None:
        try:
            while not self._stop.is_set():
                if not body():
                    time.sleep(self.tick)
        except BaseException as exc:
            self.errors.append(exc)
        finally:
            connection.close()

    def _work(self) -> None:
        def once() -> bool:
            ids = list(Run.objects.filter(tenant=self.tenant, status__in=ACTIVE).values_list("pk", flat=True))
            for run_id in ids:
                advance(run_id)
            return bool(ids)

        self._guard(once)

    def _keep(self) -> None:
        def once() -> bool:
            sweeper._admit_waiting_runs(timezone.now())
            if self.keeper is not None:
                self.keeper()
            return False

        self._guard(once)

    def quiet(self) -> bool:
        """Every run ended or waits with no way on: nothing is reserved, no run is parked for a
        slice, and the oldest run waiting to be admitted fits neither this region's room nor
        (away from home) what the home said it had free at the keeper's last pass."""
        moving = Run.objects.filter(pk__in=self.ids).exclude(status__in=(*TERMINAL, RunStatus.WAITING_BUDGET))
        if moving.exists() or Reservation.objects.filter(tenant=self.tenant, status="open").exists():
            return False
        if self.keeper is not None and regions.parked_runs(self.tenant).exists():
            return False
        head = admission.waiting_runs(self.tenant).order_by("created_at", "id").first()
        if head is None:
            return True
        room, _ = admission.room_micros(self.tenant)
        if room >= head.expected_cost_micros:
            return False
        if self.keeper is None:
            return True
        link = HomeLink.objects.filter(tenant=self.tenant).first()
        return link is not None and link.home_free_micros == 0

    def wait_quiet(self, *, timeout: float, steady: float = 3.0) -> bool:
        deadline, since = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            if self.errors:
                raise self.errors[0]
            if self.quiet():
                since = since or time.monotonic()
                if time.monotonic() - since >= steady:
                    return True
            else:
                since = None
            time.sleep(0.2)
        return False

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        connection.close()
        if self.errors:
            raise self.errors[0]


def books(tenant) -> dict:
    """This region's ledger for the tenant: every day's balances (the tenant's, each user's) and
    the steps' costs."""
    from budgets.models import BudgetAccount

    days = {}
    for row in (
        BudgetAccount.objects.filter(tenant=tenant, scope="tenant_day")
        .values("day")
        .annotate(
            limit=Sum("limit_micros"),
            reserved=Sum("reserved_micros"),
            spent=Sum("spent_micros"),
            held=Sum("held_micros"),
        )
    ):
        days[row["day"].isoformat()] = {k: row[k] for k in ("limit", "reserved", "spent", "held")}
    user_days = {
        f"{a.day.isoformat()}/{a.user_id}": {
            "limit": a.limit_micros,
            "reserved": a.reserved_micros,
            "spent": a.spent_micros,
            "held": a.held_micros,
        }
        for a in BudgetAccount.objects.filter(tenant=tenant, scope="user_day")
    }
    steps = Step.objects.filter(run__tenant=tenant).aggregate(cost=Sum("cost_micros"))["cost"] or 0
    statuses: dict[str, int] = {}
    for status in Run.objects.filter(tenant=tenant).values_list("status", flat=True):
        statuses[status] = statuses.get(status, 0) + 1
    return {"days": days, "user_days": user_days, "step_costs": steps, "runs": statuses}
