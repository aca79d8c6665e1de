"""What a user's new connection does to their runs: the calls that waited for it go on.

connections/services.py connects and revokes (and never writes run state); its callback view
calls `resume_connected` here, and the sweeper calls `resume_authorized_waits` as the backstop for
a callback whose resume did not run (a crash between the two commits).
"""

from __future__ import annotations

from connections.models import Connection, ConnectionStatus
from runs.models import Run, RunStatus, Step, StepStatus
from runs.queueing import continue_run
from runs.transitions import atomic_with_events, lock_run, transition_run, transition_step

BATCH = 500


def resume_connected(*, user_id: int, server_id: int) -> int:
    """Resume the user's runs waiting for a connection to this server; how many resumed."""
    run_ids = list(
        Run.objects.filter(
            status=RunStatus.WAITING_AUTHORIZATION,
            created_by_id=user_id,
            steps__status=StepStatus.AWAITING_AUTHORIZATION,
            steps__tool__server_id=server_id,
        )
        .values_list("pk", flat=True)
        .distinct()[:BATCH]
    )
    return sum(_resume(run_id) for run_id in run_ids)


def resume_authorized_waits() -> int:
    """Waiting runs whose user has connected meanwhile (the sweeper's backstop)."""
    pairs = set(
        Step.objects.filter(
            run__status=RunStatus.WAITING_AUTHORIZATION, status=StepStatus.AWAITING_AUTHORIZATION
        ).values_list("run__created_by_id", "tool__server_id")[:BATCH]
    )
    connected = {
        pair
        for pair in pairs
        if Connection.objects.filter(
            user_id=pair[0], server_id=pair[1], status=ConnectionStatus.ACTIVE
        ).exists()
    }
    return sum(resume_connected(user_id=user_id, server_id=server_id) for user_id, server_id in connected)


def _resume(run_id) -> bool:
    with atomic_with_events():
        run = lock_run(run_id)
        if run.status != RunStatus.WAITING_AUTHORIZATION:
            return False  # resumed, paused or ended by someone else meanwhile
        waiting = list(
            Step.objects.filter(run=run, status=StepStatus.AWAITING_AUTHORIZATION).select_related(
                "tool__server"
            )
        )
        still = [s for s in waiting if not _connected(run, s)]
        for step in waiting:
            if step not in still:
                transition_step(
                    step,
                    StepStatus.PROPOSED,
                    message=f"step {step.seq} {step.tool_name}: the user connected; checked again before it is sent",
                )
        if still:
            return False
        transition_run(run, RunStatus.RUNNING, message="resumed: the user connected the tool server")
        continue_run(run)
        return True


def _connected(run: Run, step: Step) -> bool:
    return (
        step.tool is not None
        and Connection.objects.filter(
            user_id=run.created_by_id, server_id=step.tool.server_id, status=ConnectionStatus.ACTIVE
        ).exists()
    )
