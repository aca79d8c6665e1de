"""The top floor's gauges, computed from the database when /metrics is scraped: a few aggregate queries on indexed
columns, so what is stored and what is reported cannot drift apart (nothing to keep in step
across processes). Terminal runs are counted by the transitions counter, not here: counting them
would scan a table that only grows.
"""

from __future__ import annotations

import logging

from django.conf import settings
from django.db.models import Count, Max, Min, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily

from approvals.models import Approval, ApprovalStatus
from budgets.models import BudgetAccount, Reservation
from budgets.services import local_day
from llm.models import EndpointCircuit
from observability import health
from regions.models import Heartbeat, HomeLink, RegionDay, SliceRequest, TenantRegions, here
from runs.models import TERMINAL, Run, RunEvent, RunStatus
from tenants.models import Tenant

log = logging.getLogger(__name__)
ACTIVE = [status for status in RunStatus.values if status not in TERMINAL]


def _age(oldest, now) -> float:
    return max((now - oldest).total_seconds(), 0.0) if oldest else 0.0


class DatabaseCollector:
    """Runs by status, approvals pending, held reservations; and whether the database answered."""

    def collect(self):
        up = GaugeMetricFamily("agentplatform_database_up", "1 if /metrics could read the database.")
        try:
            families = list(self._families())
        except Exception:  # a scrape must still answer (with database_up 0) when the database is down
            log.warning("metrics: database unreachable", exc_info=True)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families

    def _families(self):
        now = timezone.now()
        tenants = list(Tenant.objects.values_list("pk", "slug"))

        runs = GaugeMetricFamily(
            "agentplatform_runs", "Runs not yet ended, by tenant and status.", labels=["tenant", "status"]
        )
        counts = {
            (tenant_id, status): n
            for tenant_id, status, n in Run.objects.filter(status__in=ACTIVE)
            .values("tenant_id", "status")
            .annotate(n=Count("id"))
            .values_list("tenant_id", "status", "n")
            .order_by()
        }
        for tenant_id, tenant_slug in tenants:
            for status in ACTIVE:
                runs.add_metric([tenant_slug, status], counts.get((tenant_id, status), 0))
        yield runs

        # Operators' holds (runs/controls/pausing.py): one reason is shared by a bulk action's runs, and
        # the reason is cut, so the label set stays as small as the number of pauses people make.
        paused = GaugeMetricFamily(
            "agentplatform_runs_paused",
            "Paused runs, by tenant, agent and reason.",
            labels=["tenant", "agent", "reason"],
        )
        for slug, agent, reason, n in (
            Run.objects.filter(status=RunStatus.PAUSED)
            .values("tenant__slug", "agent__name", "pause_reason")
            .annotate(n=Count("id"))
            .values_list("tenant__slug", "agent__name", "pause_reason", "n")
            .order_by()
        ):
            paused.add_metric([slug, agent, reason[:60]], n)
        yield paused

        attention = GaugeMetricFamily(
            "agentplatform_runs_needing_attention", "Runs waiting for a person to resolve an unknown outcome."
        )
        attention.add_metric(
            [], sum(n for (_, status), n in counts.items() if status == RunStatus.NEEDS_ATTENTION)
        )
        yield attention
        # When each such run last entered needs_attention (its status event), the oldest of those.
        entered = (
            RunEvent.objects.filter(
                run__status=RunStatus.NEEDS_ATTENTION, kind="status", skeleton__to=RunStatus.NEEDS_ATTENTION
            )
            .values("run_id")
            .annotate(entered=Max("at"))
            .aggregate(oldest=Min("entered"))["oldest"]
        )
        oldest = GaugeMetricFamily(
            "agentplatform_runs_needing_attention_oldest_age_seconds",
            "Seconds since the longest-waiting run entered needs_attention (0: none).",
        )
        oldest.add_metric([], _age(entered, now))
        yield oldest

        pending = GaugeMetricFamily(
            "agentplatform_approvals_pending", "Approvals waiting for a decision.", labels=["tenant"]
        )
        pending_age = GaugeMetricFamily(
            "agentplatform_approvals_pending_oldest_age_seconds",
            "Age of the oldest pending approval (0: none).",
            labels=["tenant"],
        )
        pending_rows = {
            tenant_id: (n, first)
            for tenant_id, n, first in Approval.objects.filter(status=ApprovalStatus.PENDING)
            .values("tenant_id")
            .annotate(n=Count("id"), first=Min("created_at"))
            .values_list("tenant_id", "n", "first")
            .order_by()
        }
        for tenant_id, tenant_slug in tenants:
            n, first = pending_rows.get(tenant_id, (0, None))
            pending.add_metric([tenant_slug], n)
            pending_age.add_metric([tenant_slug], _age(first, now))
        yield pending
        yield pending_age

        held = GaugeMetricFamily(
            "agentplatform_reservations_held",
            "Reservations held as possible charges until reconciled.",
            labels=["tenant"],
        )
        held_micros = GaugeMetricFamily(
            "agentplatform_reservations_held_micros",
            "Amount held, in micro-units of the budget currency.",
            labels=["tenant"],
        )
        held_age = GaugeMetricFamily(
            "agentplatform_reservations_held_oldest_age_seconds",
            "Age of the oldest held reservation (0: none).",
            labels=["tenant"],
        )
        held_rows = {
            tenant_id: (n, amount, first)
            for tenant_id, n, amount, first in Reservation.objects.filter(status=Reservation.Status.HELD)
            .values("tenant_id")
            .annotate(n=Count("id"), amount=Sum("amount_micros"), first=Min("created_at"))
            .values_list("tenant_id", "n", "amount", "first")
            .order_by()
        }
        for tenant_id, tenant_slug in tenants:
            n, amount, first = held_rows.get(tenant_id, (0, 0, None))
            held.add_metric([tenant_slug], n)
            held_micros.add_metric([tenant_slug], amount or 0)
            held_age.add_metric([tenant_slug], _age(first, now))
        yield held
        yield held_micros
        yield held_age

        circuits = GaugeMetricFamily(
            "agentplatform_circuit_open",
            "Model endpoints whose circuit breaker is not closed (1: open or half open; llm/breaker.py).",
            labels=["tenant", "endpoint", "state"],
        )
        slugs = dict(tenants)
        for tenant_id, name, state in (
            EndpointCircuit.objects.exclude(state=EndpointCircuit.State.CLOSED)
            .values_list("endpoint__tenant_id", "endpoint__name", "state")
            .order_by()
        ):
            circuits.add_metric([slugs.get(tenant_id, ""), name, state], 1)
        yield circuits
        yield from _regions(slugs)


def _regions(slugs: dict) -> list:
    """Regions (regions/, docs/regions.md): away from home, the link, the last refill's round trip,
    requests in flight and runs parked by reason; at home, what each region holds of the day."""
    link_up = GaugeMetricFamily(
        "agentplatform_region_link_up", "1 if the tenant's home answered the last pass.", labels=["tenant"]
    )
    refill = GaugeMetricFamily(
        "agentplatform_region_refill_seconds", "Round trip of the last slice granted.", labels=["tenant"]
    )
    pending = GaugeMetricFamily(
        "agentplatform_region_requests_pending", "Grants and returns not yet answered.", labels=["tenant"]
    )
    for tenant_id, state, refill_ms in HomeLink.objects.values_list("tenant_id", "state", "refill_ms"):
        link_up.add_metric([slugs.get(tenant_id, "")], 1 if state == HomeLink.State.UP else 0)
        refill.add_metric([slugs.get(tenant_id, "")], (refill_ms or 0) / 1000)
    for tenant_id, n in (
        SliceRequest.objects.filter(status=SliceRequest.Status.PENDING)
        .values("tenant_id")
        .annotate(n=Count("id"))
        .values_list("tenant_id", "n")
        .order_by()
    ):
        pending.add_metric([slugs.get(tenant_id, "")], n)
    parked = GaugeMetricFamily(
        "agentplatform_region_runs_parked",
        "Runs parked in waiting_budget for the tenant's slice, by reason (runs/engine/decisions.py).",
        labels=["tenant", "reason"],
    )
    reasons: dict[tuple[int, str], int] = {}
    for run_id, tenant_id in Run.objects.filter(
        status=RunStatus.WAITING_BUDGET, admitted_at__isnull=False, resume_at__isnull=True
    ).values_list("pk", "tenant_id")[:10_000]:
        data = (
            RunEvent.objects.filter(run_id=run_id, kind="status")
            .order_by("-seq")
            .values_list("data", flat=True)
            .first()
        )
        reason = (data or {}).get("region_reason")
        if reason:
            reasons[(tenant_id, reason)] = reasons.get((tenant_id, reason), 0) + 1
    for (tenant_id, reason), n in reasons.items():
        parked.add_metric([slugs.get(tenant_id, ""), reason], n)
    lent = GaugeMetricFamily(
        "agentplatform_region_slices_outstanding_micros",
        "Home side: slices lent to a region and not given back (counted as spent here), latest day.",
        labels=["tenant", "region"],
    )
    latest: dict[tuple[int, str], int] = {}
    for tenant_id, region, granted, returned in (
        RegionDay.objects.filter(user=None)
        .order_by("day")
        .values_list("tenant_id", "region", "granted_micros", "returned_micros")
    ):
        latest[(tenant_id, region)] = granted - returned
    for (tenant_id, region), micros in latest.items():
        lent.add_metric([slugs.get(tenant_id, ""), region], micros)
    age = GaugeMetricFamily(
        "agentplatform_region_authority_age_seconds",
        "How old this region's copy of a home's authority is: now less the newest heartbeat of that "
        "home it holds (the replication lag the revocation reach is judged by).",
        labels=["home"],
    )
    now = timezone.now()
    for region, beat_at in Heartbeat.objects.exclude(region=here()).values_list("region", "beat_at"):
        age.add_metric([region], _age(beat_at, now))
    return [link_up, refill, pending, parked, lent, age, _slice_balance(slugs)]


def _slice_balance(slugs: dict) -> GaugeMetricFamily:
    """Away from home: the tenant's slices of its local today and where their money is. `free` is
    what runs here may still reserve before the keeper's next slice: at 0 with the link down, runs
    park "budget region unreachable". Read from the day's sub-accounts without opening a day."""
    balance = GaugeMetricFamily(
        "agentplatform_region_slice_balance_micros",
        "Away from home: the tenant's slices of today (granted less given back = limit) and their "
        "free, reserved, spent and held parts, in micros.",
        labels=["tenant", "part"],
    )
    if not here():
        return balance
    for config in TenantRegions.objects.select_related("tenant").exclude(home=here()):
        tenant = config.tenant
        day = BudgetAccount.objects.filter(
            tenant=tenant, scope=BudgetAccount.Scope.TENANT_DAY, day=local_day(tenant)
        ).aggregate(**{part: Coalesce(Sum(f"{part}_micros"), 0) for part in SLICE_PARTS})
        day["free"] = day["limit"] - day["reserved"] - day["spent"] - day["held"]
        for part in (*SLICE_PARTS, "free"):
            balance.add_metric([slugs.get(tenant.pk, tenant.slug), part], day[part])
    return balance


SLICE_PARTS = ("limit", "reserved", "spent", "held")


class BrokerCollector:
    """Messages waiting in the engine's and the sweeper's queues; whether the broker answered."""

    def collect(self):
        up = GaugeMetricFamily("agentplatform_broker_up", "1 if /metrics could reach the broker.")
        depth = GaugeMetricFamily(
            "agentplatform_broker_queue_messages", "Messages waiting in a queue.", labels=["queue"]
        )
        try:
            with health.broker_connection() as conn:
                conn.ensure_connection(
                    max_retries=1, interval_start=0, timeout=settings.READY_TIMEOUT_SECONDS
                )
                for queue in (settings.CELERY_TASK_DEFAULT_QUEUE, settings.SWEEP_QUEUE):
                    depth.add_metric([queue], _depth(conn, queue))
        except Exception:
            log.warning("metrics: broker unreachable", exc_info=True)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield depth


def _depth(conn, queue: str) -> int:
    from kombu.exceptions import ChannelError

    with conn.channel() as channel:
        try:
            return channel.queue_declare(queue, passive=True).message_count
        except ChannelError:  # never declared: no worker has consumed it yet, so nothing waits in it
            return 0
