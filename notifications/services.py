"""Notifications: find what a supervisor must hear about, then deliver it to the tenant's webhooks.

Two phases, run by one periodic task (tasks.notify) every NOTIFY_INTERVAL_SECONDS:

1. `scan`: read RunEvents past a cursor (approval requested, reminded or escalated by the sweeper,
   run entered needs_attention), AliasChanges past another (a canary rolled back or promoted) and
   pending approvals about to expire, and create one Delivery per (webhook, subject, event). The
   unique constraint makes the scan idempotent, so scans may overlap and events may be re-read.
   The engine is not touched: it already writes these events (and agents.services the changes).
2. `send_due`: claim one due delivery at a time (SELECT ... FOR UPDATE SKIP LOCKED, then a lease:
   `next_attempt_at` moved past the attempt's deadline, `attempts` + 1, an attempt row), commit,
   POST outside any transaction, then record the outcome only if `attempts` still equals the
   claimed number (the attempt number fences out a sender whose lease ran out).

Error contract of a POST: a 2xx answer delivers; any other answer, a timeout or a connection error
is retried with exponential backoff and jitter until NOTIFY_MAX_ATTEMPTS; a URL the tenant's
egress hosts no longer allow fails the delivery at once without sending anything.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import httpx
from django.conf import settings
from django.db import transaction
from django.db.models import CharField, DurationField, Exists, ExpressionWrapper, F, Max, OuterRef, Q, Value
from django.db.models.functions import Cast
from django.utils import timezone

from agents.models import AliasChange
from approvals.models import Approval, ApprovalStatus
from notifications.models import (
    Delivery,
    DeliveryAttempt,
    DeliveryCounter,
    DeliveryStatus,
    Event,
    ScanCursor,
    Webhook,
)
from notifications.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER, signature
from runs.models import RunEvent, RunStatus
from tenants.crypto import SecretKeyError
from tenants.models import User
from tools.origins import OriginError, host_allowed

BATCH = 500
CURSOR = "run_events"
ALIAS_CURSOR = "alias_changes"
# How long a claimed attempt may take before another sender may take the delivery over: the
# POST's own deadline plus room for the two short transactions around it.
LEASE_MARGIN_SECONDS = 15
USER_AGENT = "agentplatform-webhooks/1"


# --- phase 1: scan -------------------------------------------------------------------------------


def scan(now: dt.datetime | None = None) -> dict[str, int]:
    """Create the deliveries that events and approvals call for; return how many were new."""
    now = now or timezone.now()
    hooks = _hooks_by_tenant()
    if not hooks:
        return {"created": 0}
    return {
        "created": _scan_run_events(now, hooks) + _scan_alias_changes(now, hooks) + _scan_expiring(now, hooks)
    }


def _hooks_by_tenant() -> dict[int, list[Webhook]]:
    hooks: dict[int, list[Webhook]] = defaultdict(list)
    for hook in Webhook.objects.filter(enabled=True).select_related("tenant"):
        hooks[hook.tenant_id].append(hook)
    return hooks


def _wants(hook: Webhook, event: str) -> bool:
    return event in hook.events


_REMINDERS = {"approval_reminder": Event.APPROVAL_REMINDER, "approval_escalated": Event.APPROVAL_ESCALATED}
_WATCHED = (
    Q(kind="approval_requested")
    | Q(kind__in=list(_REMINDERS))
    | Q(kind="status", skeleton__to=RunStatus.NEEDS_ATTENTION)
    | Q(kind="status", skeleton__to=RunStatus.WAITING_AUTHORIZATION)
    | Q(kind__in=["paused", "resumed"])
)
_PAUSES = {"paused": Event.RUN_PAUSED, "resumed": Event.RUN_RESUMED}


def _scan_run_events(now: dt.datetime, hooks: dict[int, list[Webhook]]) -> int:
    """Events past the cursor, and events of the last NOTIFY_LOOKBACK_SECONDS again.

    Ids are handed out when an event is inserted but become visible when its transaction commits,
    so an event with a lower id can appear after the cursor moved past it. Re-reading recent
    events catches those; the unique constraint turns the re-reads into no-ops.
    """
    top = RunEvent.objects.aggregate(top=Max("id"))["top"] or 0
    cursor, _ = ScanCursor.objects.get_or_create(name=CURSOR, defaults={"last_id": top})
    watched = RunEvent.objects.filter(_WATCHED, run__tenant_id__in=list(hooks)).select_related(
        "run__agent", "run__created_by"
    )
    fresh = list(watched.filter(id__gt=cursor.last_id, id__lte=top).order_by("id")[:BATCH])
    since = now - dt.timedelta(seconds=settings.NOTIFY_LOOKBACK_SECONDS)
    late = list(watched.filter(id__lte=cursor.last_id, at__gte=since).order_by("id")[:BATCH])
    created = _create(_event_deliveries([*late, *fresh], hooks))
    # A full batch means more may follow; otherwise everything up to `top` was read.
    reached = fresh[-1].id if len(fresh) == BATCH else top
    ScanCursor.objects.filter(name=CURSOR, last_id__lt=reached).update(last_id=reached)
    return created


_CANARY_ENDS = {
    AliasChange.Kind.ROLLED_BACK: Event.CANARY_ROLLED_BACK,
    AliasChange.Kind.PROMOTED: Event.CANARY_PROMOTED,
}


def _scan_alias_changes(now: dt.datetime, hooks: dict[int, list[Webhook]]) -> int:
    """Canaries rolled back (by the watcher or by hand) or promoted since the cursor, with the
    same look-back as run events: a change's id is handed out at insert but seen at commit."""
    top = AliasChange.objects.aggregate(top=Max("id"))["top"] or 0
    cursor, _ = ScanCursor.objects.get_or_create(name=ALIAS_CURSOR, defaults={"last_id": top})
    watched = AliasChange.objects.filter(
        kind__in=list(_CANARY_ENDS), alias__agent__tenant_id__in=list(hooks)
    ).select_related("alias__agent", "actor")
    fresh = list(watched.filter(id__gt=cursor.last_id, id__lte=top).order_by("id")[:BATCH])
    since = now - dt.timedelta(seconds=settings.NOTIFY_LOOKBACK_SECONDS)
    late = list(watched.filter(id__lte=cursor.last_id, at__gte=since).order_by("id")[:BATCH])
    deliveries = []
    for change in [*late, *fresh]:
        kind = _CANARY_ENDS[AliasChange.Kind(change.kind)]
        payload = {
            "occurred_at": change.at.isoformat(),
            "agent": change.alias.agent.name,
            "alias": change.alias.name,
            # The alias's version after the change, and the canary's that ended.
            "version": change.version,
            "canary_version": change.canary_version,
            "automatic": change.automatic,
            "actor": change.actor.username if change.actor else None,
            "reason": change.reason,
        }
        if change.data:
            payload["arms"] = change.data  # the watcher's figures per arm
        tenant_id = change.alias.agent.tenant_id
        for hook in hooks.get(tenant_id, []):
            if _wants(hook, kind) and change.at >= hook.created_at:
                deliveries.append(_delivery(hook, kind, f"alias_change:{change.pk}", payload, run_id=None))
    created = _create(deliveries)
    reached = fresh[-1].id if len(fresh) == BATCH else top
    ScanCursor.objects.filter(name=ALIAS_CURSOR, last_id__lt=reached).update(last_id=reached)
    return created


def _event_deliveries(events: list[RunEvent], hooks: dict[int, list[Webhook]]) -> list[Delivery]:
    approval_ids = [
        e.data.get("approval") for e in events if e.kind == "approval_requested" or e.kind in _REMINDERS
    ]
    approvals = {
        str(a.pk): a
        for a in Approval.objects.filter(pk__in=[i for i in approval_ids if i]).select_related(
            "tool", "requested_by"
        )
    }
    escalated = _members_by_username(events)
    deliveries = []
    for event in events:
        run = event.run
        if event.kind == "approval_requested":
            approval = approvals.get(str(event.data.get("approval")))
            if approval is None:
                continue
            kind, subject = Event.APPROVAL_REQUESTED, str(approval.pk)
            payload = {"occurred_at": event.at.isoformat(), **_approval_payload(approval, run)}
        elif event.kind in _REMINDERS:
            approval = approvals.get(str(event.data.get("approval")))
            # Decided or expired since the sweeper recorded it: a reminder now would only mislead.
            if approval is None or approval.status != ApprovalStatus.PENDING:
                continue
            kind, subject = _REMINDERS[event.kind], str(approval.pk)
            payload = {
                "occurred_at": event.at.isoformat(),
                "pending_seconds": event.data.get("pending_seconds"),
                **_approval_payload(approval, run),
            }
            if event.kind == "approval_escalated":
                payload["escalated_to"] = {
                    "group": event.data.get("group"),
                    "members": [
                        escalated.get((run.tenant_id, name), {"username": name})
                        for name in event.data.get("members") or []
                    ],
                }
        elif event.kind in _PAUSES:
            kind, subject = _PAUSES[event.kind], f"{run.pk}:{event.seq}"
            payload = {
                "occurred_at": event.at.isoformat(),
                "run": _run_payload(run),
                "reason": event.data.get("reason") or event.message,
            }
        elif event.data.get("to") == RunStatus.WAITING_AUTHORIZATION:
            kind, subject = Event.RUN_WAITING_AUTHORIZATION, f"{run.pk}:{event.seq}"
            payload = {
                "occurred_at": event.at.isoformat(),
                "run": _run_payload(run),
                "server": event.data.get("server", ""),
                "user": event.data.get("user", ""),
                "connect_url": event.data.get("connect_url", ""),
            }
        else:
            kind, subject = Event.RUN_NEEDS_ATTENTION, f"{run.pk}:{event.seq}"
            payload = {
                "occurred_at": event.at.isoformat(),
                "run": _run_payload(run),
                "reason": event.message,
            }
        for hook in hooks.get(run.tenant_id, []):
            # A webhook hears of what happened after it was made, not of the tenant's history.
            if _wants(hook, kind) and event.at >= hook.created_at:
                deliveries.append(_delivery(hook, kind, subject, payload, run_id=run.pk))
    return deliveries


def _members_by_username(events: list[RunEvent]) -> dict[tuple, dict]:
    """(tenant id, username) -> the member as the receiver needs them, for escalation events (one
    query for the batch; the usernames are those the escalation named, so the notice matches the
    timeline)."""
    names = {name for e in events if e.kind == "approval_escalated" for name in e.data.get("members") or []}
    if not names:
        return {}
    return {
        (user.tenant_id, user.username): {
            "username": user.username,
            "name": user.get_full_name(),
            "email": user.email,
        }
        for user in User.objects.filter(
            username__in=names, tenant_id__in={e.run.tenant_id for e in events}
        ).only("username", "first_name", "last_name", "email", "tenant_id")
    }


def _scan_expiring(now: dt.datetime, hooks: dict[int, list[Webhook]]) -> int:
    """Pending approvals that expire within NOTIFY_EXPIRING_WITHIN_SECONDS.

    An approval whose whole lifetime is shorter than the window is left out: the notice of its
    request already carried its expiry, and a second one at once would only be noise.
    """
    window = dt.timedelta(seconds=settings.NOTIFY_EXPIRING_WITHIN_SECONDS)
    lifetime = ExpressionWrapper(F("expires_at") - F("created_at"), output_field=DurationField())
    deliveries = []
    for tenant_hooks in hooks.values():
        for hook in tenant_hooks:
            if not _wants(hook, Event.APPROVAL_EXPIRING):
                continue
            approvals = (
                Approval.objects.filter(
                    tenant_id=hook.tenant_id,
                    status=ApprovalStatus.PENDING,
                    expires_at__gt=now,
                    expires_at__lte=now + window,
                )
                .alias(lifetime=lifetime)
                .filter(lifetime__gt=Value(window))
                .exclude(
                    # Already notified: found through the unique index, not by reading every
                    # delivery the webhook ever had.
                    Exists(
                        Delivery.objects.filter(
                            webhook=hook,
                            subject=Cast(OuterRef("pk"), CharField()),
                            event=Event.APPROVAL_EXPIRING,
                        )
                    )
                )
                .select_related("tool", "requested_by", "run__agent", "run__created_by")[:BATCH]
            )
            for approval in approvals:
                payload = {
                    "occurred_at": now.isoformat(),
                    "expires_in_seconds": int((approval.expires_at - now).total_seconds()),
                    **_approval_payload(approval, approval.run),
                }
                deliveries.append(
                    _delivery(
                        hook, Event.APPROVAL_EXPIRING, str(approval.pk), payload, run_id=approval.run_id
                    )
                )
    return _create(deliveries)


def _run_payload(run) -> dict:
    return {"id": str(run.pk), "agent": run.agent.name, "created_by": run.created_by.username}


def _approval_payload(approval: Approval, run) -> dict:
    # Ids and names only: the call's arguments may hold customer data; the admin shows them.
    return {
        "run": _run_payload(run),
        "approval": {
            "id": str(approval.pk),
            "tool": approval.tool.name,
            "reason": approval.reason,
            "requested_by": approval.requested_by.username,
            "expires_at": approval.expires_at.isoformat(),
        },
    }


def _delivery(hook: Webhook, kind: str, subject: str, payload: dict, *, run_id) -> Delivery:
    approval_id = payload.get("approval", {}).get("id")
    return Delivery(
        tenant_id=hook.tenant_id,
        webhook=hook,
        event=kind,
        subject=subject,
        run_id=run_id,
        approval_id=approval_id,
        payload={"tenant": hook.tenant.slug, **payload},
        next_attempt_at=timezone.now(),
    )


def _create(deliveries: list[Delivery]) -> int:
    """Insert those not made yet: a notification is made once per (webhook, subject, event)."""
    if not deliveries:
        return 0
    existing = set(
        Delivery.objects.filter(  # the unique index (webhook, subject, event) answers this
            webhook_id__in={d.webhook_id for d in deliveries}, subject__in={d.subject for d in deliveries}
        ).values_list("webhook_id", "subject", "event")
    )
    new = [d for d in deliveries if (d.webhook_id, d.subject, d.event) not in existing]
    by_tenant: dict[int, list[Delivery]] = defaultdict(list)
    for delivery in new:
        by_tenant[delivery.tenant_id].append(delivery)
    for tenant_id, group in by_tenant.items():
        for delivery, number in zip(group, _numbers(tenant_id, len(group)), strict=True):
            delivery.number = number
    # A concurrent scan may insert the same rows meanwhile: the unique constraint on (webhook,
    # subject, event) decides, leaving a gap in the loser's numbers, and the count returned may
    # then be a little high (it is only reported). Numbers never collide: each was taken once.
    Delivery.objects.bulk_create(new, ignore_conflicts=True)
    return len(new)


def _numbers(tenant_id: int, count: int) -> range:
    """Take the tenant's next `count` delivery numbers (the counter's row is locked until commit,
    so the value read back after the increment is this call's alone)."""
    with transaction.atomic():
        DeliveryCounter.objects.get_or_create(tenant_id=tenant_id)
        DeliveryCounter.objects.filter(tenant_id=tenant_id).update(last=F("last") + count)
        last = DeliveryCounter.objects.values_list("last", flat=True).get(tenant_id=tenant_id)
    return range(last - count + 1, last + 1)


# --- phase 2: send -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    """One attempt of one delivery, taken under a lease; everything the POST needs."""

    delivery_id: int
    number: int  # what the receiver sees (per tenant)
    attempt: int
    url: str
    secret: str
    body: bytes
    event: str
    egress_hosts: list[str] | None


@dataclass(frozen=True)
class Outcome:
    status_code: int | None = None
    error: str = ""
    permanent: bool = False  # retrying cannot help (the URL is no longer allowed)

    @property
    def delivered(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


def send_due(*, budget_seconds: float | None = None) -> dict[str, int]:
    """Send due deliveries one claim at a time, for at most `budget_seconds` (one scan interval)."""
    budget = settings.NOTIFY_TIMEOUT_SECONDS if budget_seconds is None else budget_seconds
    deadline = time.monotonic() + budget
    counts = {"delivered": 0, "retrying": 0, "failed": 0}
    while time.monotonic() < deadline:
        claim = claim_next()
        if claim is None:
            break
        counts[record(claim, post(claim))] += 1
    return counts


def claim_next(now: dt.datetime | None = None) -> Claim | None:
    """Take the next due delivery: attempt + 1 and a lease, in one short transaction."""
    now = now or timezone.now()
    lease = dt.timedelta(seconds=settings.NOTIFY_TIMEOUT_SECONDS + LEASE_MARGIN_SECONDS)
    while True:
        with transaction.atomic():
            # SKIP LOCKED: concurrent senders pass over a row another is claiming instead of
            # waiting for it; the lease then keeps it from them once that claim commits.
            delivery = (
                Delivery.objects.select_for_update(skip_locked=True, of=("self",))
                .filter(status=DeliveryStatus.PENDING, next_attempt_at__lte=now, webhook__enabled=True)
                .select_related("webhook", "tenant")
                .order_by("next_attempt_at")
                .first()
            )
            if delivery is None:
                return None
            if delivery.attempts >= settings.NOTIFY_MAX_ATTEMPTS:
                # Its last attempt's sender died (the lease ran out with no answer recorded).
                _finish(
                    delivery.pk, delivery.attempts, DeliveryStatus.FAILED, now, error="no answer recorded"
                )
                continue
            attempt = delivery.attempts + 1
            Delivery.objects.filter(pk=delivery.pk).update(attempts=attempt, next_attempt_at=now + lease)
            DeliveryAttempt.objects.create(delivery=delivery, number=attempt, started_at=now)
            try:
                secret = delivery.webhook.signing_secret()
            except SecretKeyError as exc:
                _finish(delivery.pk, attempt, DeliveryStatus.FAILED, now, error=str(exc))
                _complete_attempt(delivery.pk, attempt, Outcome(error=str(exc)), None)
                continue
        return Claim(
            delivery_id=delivery.pk,
            number=delivery.number,
            attempt=attempt,
            url=delivery.webhook.url,
            secret=secret,
            body=body_of(delivery),
            event=delivery.event,
            egress_hosts=delivery.tenant.egress_hosts,
        )


def body_of(delivery: Delivery) -> bytes:
    """The JSON body: the same bytes on every attempt (receivers dedupe on `id`, the delivery's
    number in its tenant)."""
    document = {"id": delivery.number, "event": delivery.event, **delivery.payload}
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode("utf-8")


def egress_refusal(url: str, egress_hosts: list[str] | None) -> str:
    """Why the tenant's egress hosts refuse `url` ("" when they allow it; None allows all)."""
    if egress_hosts is None:
        return ""
    try:
        allowed = host_allowed(url, egress_hosts)
    except OriginError as exc:
        return str(exc)
    return "" if allowed else "host is not in tenant.egress_hosts"


def post(claim: Claim) -> Outcome:
    """POST once, outside any transaction, with hard deadlines; never raises."""
    # Checked again at each attempt: a narrower list must stop deliveries made under a wider one.
    refusal = egress_refusal(claim.url, claim.egress_hosts)
    if refusal:
        return Outcome(error=f"{refusal}; nothing sent", permanent=True)
    timestamp = str(int(time.time()))
    headers = {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        TIMESTAMP_HEADER: timestamp,
        SIGNATURE_HEADER: signature(claim.secret, timestamp, claim.body),
        "X-Delivery-Id": str(claim.number),
        "X-Delivery-Attempt": str(claim.attempt),
        "X-Event": claim.event,
    }
    # Every phase (connect, write, each read) is bounded; the answer's body is never read, so a
    # receiver that streams one forever does not hold the sender. No redirects: the egress check
    # above is for this URL, not wherever it points. trust_env=False: no proxy from the environment.
    timeout = httpx.Timeout(settings.NOTIFY_TIMEOUT_SECONDS)
    try:
        with (
            httpx.Client(timeout=timeout, follow_redirects=False, trust_env=False) as client,
            client.stream("POST", claim.url, content=claim.body, headers=headers) as response,
        ):
            return Outcome(status_code=response.status_code)
    except httpx.HTTPError as exc:
        return Outcome(error=f"{type(exc).__name__}: {exc}"[:1000])


def record(claim: Claim, outcome: Outcome, now: dt.datetime | None = None) -> str:
    """Write the attempt's outcome; the delivery moves only if this claim still holds it."""
    now = now or timezone.now()
    retry_at = None
    with transaction.atomic():
        if outcome.delivered:
            _finish(claim.delivery_id, claim.attempt, DeliveryStatus.DELIVERED, now, outcome.status_code)
            result = "delivered"
        elif outcome.permanent or claim.attempt >= settings.NOTIFY_MAX_ATTEMPTS:
            _finish(
                claim.delivery_id,
                claim.attempt,
                DeliveryStatus.FAILED,
                now,
                outcome.status_code,
                outcome.error,
            )
            result = "failed"
        else:
            retry_at = now + dt.timedelta(seconds=backoff(claim.attempt))
            Delivery.objects.filter(
                pk=claim.delivery_id, attempts=claim.attempt, status=DeliveryStatus.PENDING
            ).update(
                next_attempt_at=retry_at,
                last_status_code=outcome.status_code,
                last_error=outcome.error or f"HTTP {outcome.status_code}",
            )
            result = "retrying"
        _complete_attempt(claim.delivery_id, claim.attempt, outcome, retry_at, now)
    return result


def backoff(attempt: int) -> float:
    """Seconds before attempt `attempt + 1`: doubling from NOTIFY_BACKOFF_SECONDS, capped, with
    "equal jitter" (half fixed, half random), so waits spread out yet never shrink from one
    attempt to the next."""
    ceiling = min(settings.NOTIFY_BACKOFF_MAX_SECONDS, settings.NOTIFY_BACKOFF_SECONDS * 2 ** (attempt - 1))
    return ceiling / 2 + random.uniform(0, ceiling / 2)


def _finish(
    delivery_id: int,
    attempt: int,
    to: str,
    now: dt.datetime,
    status_code: int | None = None,
    error: str = "",
) -> bool:
    """pending -> delivered | failed, as one conditional update fenced by the attempt number."""
    fields: dict[str, Any] = {"status": to, "last_status_code": status_code, "last_error": error}
    if to == DeliveryStatus.DELIVERED:
        fields["delivered_at"] = now
    return bool(
        Delivery.objects.filter(pk=delivery_id, attempts=attempt, status=DeliveryStatus.PENDING).update(
            **fields
        )
    )


def _complete_attempt(
    delivery_id: int,
    attempt: int,
    outcome: Outcome,
    retry_at: dt.datetime | None,
    now: dt.datetime | None = None,
) -> None:
    DeliveryAttempt.objects.filter(delivery_id=delivery_id, number=attempt, finished_at__isnull=True).update(
        finished_at=now or timezone.now(),
        status_code=outcome.status_code,
        error=outcome.error,
        retry_at=retry_at,
    )
