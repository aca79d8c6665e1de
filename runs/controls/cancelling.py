"""Cancel in bulk: every run a filter matches, with a reason, as one audited BulkAction.

    cancel_matching(actor, reason, filters)   runs.services.cancel_run on each live run the
                                              filters match that is not already being
                                              cancelled, oldest first, each in its own short
                                              transaction; answers the BulkAction with the count

Each run is cancelled exactly as one cancel would be: at once if no worker holds it, otherwise by
its holder when the call in flight is recorded; a call whose outcome is unknown first needs a
person (the run waits in needs_attention). Who may: as for pausing (platform operators everywhere,
a tenant's supervisors for their tenant), reason required. A preview (pausing.preview) says how
many runs it would move before anyone commits to it.
"""

from __future__ import annotations

from runs.controls import pausing
from runs.models import BulkAction, Run


def cancel_matching(*, actor, reason: str, filters: dict) -> BulkAction:
    # Here, not at the top: the admin imports this module first, and runs.services loaded first
    # enters the engine through runs.authority_copy while runs.engine.claim still needs it.
    from runs import services

    def move(run: Run, action: int, count: int) -> bool:
        if run.cancel_requested or run.is_terminal:
            return False  # cancelled meanwhile (by a person or another action)
        services.cancel_run(run_id=run.pk, actor=actor, reason=reason, bulk=action)
        return True

    return pausing.run_bulk(BulkAction.Kind.CANCEL, actor=actor, reason=reason, filters=filters, move=move)
