"""The run loop: claim, act, record — at most one step per Celery task (DESIGN.md section 3).

    claim   short transaction, run row locked: take the lease, decide the next step from the
            durable step log (never from the message), apply decisions that need no network
            (denials, approvals requested, replays, stops).
    reserve budget, in its own transaction (budget rows are never locked together with a run).
    mark    short transaction, run row locked: check the lease and the cancel flag, commit the
            step as `dispatching` (with its idempotency key) before anything is sent.
    act     no transaction and no database connection held: call the model or the tool.
    settle  budget, in its own transaction.
    record  short transaction, run row locked: write the outcome only if the lease token still
            matches; a fenced-out worker only adds a late-attempt event.
    continue enqueue the next task on commit, or park the run.

The phases live in their own modules:

    runs/engine/claim.py       claim: lease, decide, plan a model or tool call or a recovery; deny, replay
    runs/engine/dispatch.py    reserve and mark (both step kinds); writing an outcome through a database
                        outage; the budget event
    runs/engine/model_step.py  a model step: act, settle, record; a model call lost with its worker
    runs/engine/tool_step.py   a tool step: reconcile, act, settle, record; retries, unknown outcomes,
                        late results

This module holds the entry point; `runs/engine/types.py` holds the `Plan` a claim hands on and the
`ToolOutcome` of a tool call; `runs.lifecycle.continue_run` enqueues the next step.
"""

from __future__ import annotations

import datetime as dt

from observability import observe
from runs.engine.claim import claim
from runs.engine.model_step import do_model, recover_model
from runs.engine.tool_step import do_tool


def advance(run_id, *, enqueued_at: dt.datetime | None = None) -> dict:
    """Perform at most one step of the run. Safe to call any number of times, concurrently.

    `enqueued_at` comes with a queued message: a message older than the run's last enqueue was
    superseded by a newer one and does nothing. Returns what the step did (the task's result).
    """
    with observe.step_scope(run_id) as report:  # log lines carry the run id; Flower shows the report
        plan = claim(run_id, enqueued_at)
        if plan is None:
            return report.summary()
        if plan.kind == "recover_model":
            recover_model(plan)
        elif plan.kind == "model":
            do_model(plan)
        else:
            do_tool(plan)
        return report.summary()
