"""Erasure of a data subject's content (docs/history.md, "Erasure").

    erase_subject(...)   find every run of the tenant carrying the identifier (history/subjects.py),
                         refuse (409, naming them) if a legal hold covers any or one is still live,
                         else remove the content of each (history/content.py), keeping its
                         skeleton and writing a `content_removed` event into its chain, and
                         write one certificate

What is erased of a run carrying the identifier: all its content (history/content.py lists it),
not only the items that carry the identifier verbatim, since a model's reply or a tool's result
may restate the subject's data in other words; of its events, those whose message or data carry
the identifier. The chain still verifies: it holds digests, not content.

How: plain overwrite of the content columns in one transaction (crypto-shredding is not built:
docs/history.md says what that would add and what overwriting leaves in dead row versions, WAL
and backups). Lock order: the tenant's hold lock (history/holds.py), then the runs in id order
(runs.transitions.lock_run's row lock), then their rows. Idempotent by (tenant, request_ref): a
retried request gets the first one's certificate.
"""

from __future__ import annotations

import hashlib

from django.db import IntegrityError

from core.errors import Conflict
from history import content, holds, subjects
from history.models import ContentRemoval, ErasureCertificate
from runs.models import TERMINAL, Run
from runs.transitions import atomic_with_events


def identifier_digest(identifier: str) -> str:
    return hashlib.sha256(identifier.strip().encode("utf-8")).hexdigest()


def erase_subject(
    *, tenant_id, identifier: str, request_ref: str, actor, reason: str = ""
) -> ErasureCertificate:
    request_ref = request_ref.strip()
    if not request_ref:
        raise Conflict("an erasure needs the request's reference", code="request_ref_required")
    kept = ErasureCertificate.objects.filter(tenant_id=tenant_id, request_ref=request_ref).first()
    if kept is not None:
        return _same_request(kept, identifier)
    try:
        with atomic_with_events():
            holds.tenant_hold_lock(tenant_id)
            found = subjects.find(tenant_id, identifier)
            run_ids = sorted(found.run_ids(), key=str)
            held = holds.holds_over(tenant_id, run_ids)
            if held:
                unique = {h.pk: h for hs in held.values() for h in hs}
                raise holds.Held(list(unique.values()))
            # The runs in id order, locked as the engine locks them (its claim waits meanwhile).
            runs = list(Run.objects.select_for_update().filter(pk__in=run_ids).order_by("pk"))
            live = [str(r.pk) for r in runs if r.status not in TERMINAL]
            if live:
                raise Conflict(
                    f"refused: runs still live (cancel them or wait for them to end): {', '.join(live)}",
                    code="runs_live",
                )
            certificate = ErasureCertificate.objects.create(
                tenant_id=tenant_id,
                request_ref=request_ref,
                identifier_digest=identifier_digest(identifier),
                reason=reason,
                erased_by=actor,
                runs=[str(r) for r in run_ids],
                counts=found.counts(),
            )
            for run in runs:
                content.remove_content(
                    run,
                    why=ContentRemoval.Why.ERASURE,
                    actor=actor,
                    events=found.events.get(run.pk, []),
                    certificate=certificate,
                    note=f"content erased under request {certificate.request_ref}",
                )
    except IntegrityError:
        # The same request, retried at the same moment: the first one's certificate.
        kept = ErasureCertificate.objects.get(tenant_id=tenant_id, request_ref=request_ref)
        return _same_request(kept, identifier)
    return certificate


def _same_request(kept: ErasureCertificate, identifier: str) -> ErasureCertificate:
    if kept.identifier_digest != identifier_digest(identifier):
        raise Conflict(
            f"request {kept.request_ref} already erased another identifier", code="request_ref_reused"
        )
    return kept
