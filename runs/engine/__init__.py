"""The run loop: at most one step per Celery task, in two transactions (DESIGN.md section 3).

    claim   one short transaction, the run row locked once: take the lease, decide the next step
            from the step log (never from the message), apply decisions that need no network
            (denials, approvals requested, replays, stops), reserve the call's worst-case cost and
            commit the step as `dispatching` with its idempotency key.
    act     no transaction and no database connection held: call the model or the tool.
    record  one short transaction, the run row locked: close the reservation (settle, hold or
            release), write the outcome only if the lease token still matches (a fenced-out
            worker only adds a late-attempt event), the step's events in one INSERT, and enqueue
            the next task on commit or park the run. Retried from scratch on a lost connection
            while the lease lasts (dispatch.through_database_outage).

Lock order, in every transaction that takes more than one: the run row, then its steps (and
other rows of that run: approvals, events), then the tool's day-totals rows of a policy decision
(one tool, one day: approvals/calls.py), then the budget accounts of ONE reservation, locked
by one ledger statement in the ledger's own order (tenant-day sub-accounts by shard, user day,
run account; budgets/statements.py); a reservation that finds no sub-account of the day free
with room has locked nothing, and its second statement takes the whole day in that same order
(budgets/services.py). Why this cannot deadlock: the engine's two transactions
are the only ones that hold a run and budget accounts together, each holds exactly one run and
locks it first, and after its budget statement it locks nothing another transaction could hold
while waiting for budget accounts (rows of its own run, which it holds, and new rows); every
other budget statement (the sweeper's holds, orphan releases, a person's reconcile) commits
alone and waits for no run. The rare second ledger statement in one transaction (a late reply
reconciling its hold, an approval used up between reserve and mark) closes the same reservation,
whose accounts that transaction already holds.

The phases live in their own modules:

    runs/engine/claim.py       claim: lease, decide, plan a model or tool call or a recovery; deny, replay
    runs/engine/dispatch.py    reserve and mark (both step kinds, in the claim's transaction);
                               writing an outcome through a database outage; the budget event
    runs/engine/model_step.py  a model step: act, then settle and record; a model call lost with its worker
    runs/engine/tool_step.py   a tool step: reconcile, act, then settle and record; retries, unknown
                               outcomes, late results

This module holds the entry point; `runs/engine/types.py` holds the frozen plans a claim hands on
(`ModelCall`, `ToolCall`, `LostModelCall`) and the `ToolOutcome` of a tool call; `runs.queueing.continue_run` enqueues the next step;
`runs/statements.py` holds the hand-written SQL of the hot path.
"""

from __future__ import annotations

import datetime as dt
import logging

from django.conf import settings
from django.db import InterfaceError, OperationalError

from observability import observe
from runs.engine import failures
from runs.engine.claim import claim
from runs.engine.model_step import do_model, recover_model
from runs.engine.tool_step import do_tool
from runs.engine.types import LostModelCall, ModelCall, ToolCall

log = logging.getLogger(__name__)


def advance(run_id, *, enqueued_at: dt.datetime | None = None) -> dict:
    """Perform at most one step of the run. Safe to call any number of times, concurrently.

    `enqueued_at` comes with a queued message: a message older than the run's last enqueue was
    superseded by a newer one and does nothing. Returns what the step did (the task's result).

    An exception raised by the engine's own code (a bug, an illegal transition, a constraint) is
    never an endless loop: it is recorded on the run with its type and message and counts toward
    the step's crash budget like a worker death (runs/engine/failures.py); a lost database is not
    the engine's fault and is left to the task's own retry.
    """
    with observe.step_scope(run_id) as report:  # log lines carry the run id; Flower shows the report
        plan = None
        try:
            plan = claim(run_id, enqueued_at)
            if plan is None:
                return report.summary()
            match plan:
                case LostModelCall():
                    recover_model(plan)
                case ModelCall():
                    do_model(plan)
                case ToolCall():
                    do_tool(plan)
        except (OperationalError, InterfaceError):
            raise
        except Exception as exc:
            log.exception("the engine raised on run %s", run_id)
            failures.engine_failed(
                run_id, exc, max_crashes=settings.MAX_STEP_CRASHES, token=plan.token if plan else None
            )
        return report.summary()
