"""Destroying the data keys of runs whose content is gone (vault/: crypto-shredding).

Content removal (history/content.py) destroys its run's key once its transaction commits. This
pass catches what that could miss: a key store unreachable at that moment, a process killed in
between, and runs deleted whole (skeleton retention, a month's partitions dropped), whose rows
Django or PostgreSQL removed without a word to the key store. It pages through the key store and
destroys the keys of runs with a content removal, and of runs that no longer exist once the key
is older than KEY_GRACE (a run's files are sealed inside the transaction that creates it, so its
key can exist a moment before the run does).
"""

from __future__ import annotations

import datetime as dt
import logging

from django.utils import timezone

from history.models import ContentRemoval
from runs.models import Run
from vault import sealing, store

log = logging.getLogger(__name__)
KEY_GRACE = dt.timedelta(hours=1)


def shred_quietly(run_ids) -> None:
    """After a content removal's commit: destroy the keys, or leave them to the pass."""
    try:
        sealing.shred(run_ids)
    except sealing.KeyStoreUnavailable as exc:
        log.warning("content keys of %d runs left for the next shredding pass: %s", len(run_ids), exc)


def shred_forgotten(*, page: int = 1000, now: dt.datetime | None = None) -> int:
    """One pass over the key store; how many keys it destroyed."""
    now = now or timezone.now()
    destroyed, after = 0, ""
    while True:
        ids = store.page(after, page)
        if not ids:
            return destroyed
        after = ids[-1]
        ids = [i for i in ids if not i.startswith(sealing.WORDS_KEY)]  # a tenant's, not a run's
        removed = {
            str(r) for r in ContentRemoval.objects.filter(run_id__in=ids).values_list("run_id", flat=True)
        }
        alive = {str(r) for r in Run.objects.filter(pk__in=ids).values_list("pk", flat=True)}
        if removed:
            destroyed += sealing.shred(sorted(removed))
        gone = [r for r in ids if r not in alive]
        if gone:
            destroyed += store.destroy_older(gone, now - KEY_GRACE)
