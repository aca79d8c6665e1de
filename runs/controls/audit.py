"""The admin's "Recent actions" for operator controls: one LogEntry per pause, resume, cancel and
switch flip, whether it came through the admin, the API or a command.

    logged(actor, obj, message, added=False)   one LogEntry on `obj` (a run or a kill switch),
                                               attributed to `actor`

Written by the services, inside the transaction that makes the change, so an entry exists exactly
when the change does; the admin's own log_addition/log_change stay off for these models (they
would log twice). The platform's own moves (a pause that ended, a switch's resumes) have no person
to attribute: their record is the run's event, not a LogEntry (LogEntry.user cannot be empty).
"""

from __future__ import annotations

from django.contrib.admin.models import ADDITION, CHANGE, LogEntry


def logged(actor, obj, message: str, *, added: bool = False) -> None:
    if actor is None or actor.pk is None:
        return
    LogEntry.objects.log_actions(
        user_id=actor.pk,
        queryset=[obj],
        action_flag=ADDITION if added else CHANGE,
        change_message=message[:1000],
        single_object=True,
    )
