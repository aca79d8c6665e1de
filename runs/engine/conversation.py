"""The conversation a model call is sent, kept per worker process and read incrementally.

A model call is planned only when no step of the run is open (runs/engine/decisions.next_move),
so every step up to the latest is final then: its turn in the conversation never changes again.
A process therefore keeps each run's conversation as it last built it, with the seq it reaches,
and the next model call of that run reads only the steps after it (usually the previous model
call and its tool calls) instead of the whole log. A run whose last steps another process made
is read from where this process left it; one it has never seen (or has forgotten: the cache is
bounded) is read whole, once. The context policy then shapes the list (llm/context.py), which is cheap
pure Python next to reading and decoding every row; its compaction plan is kept beside the
conversation too, so that the next call replays only its own call points (llm/compaction.py).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field

from approvals.models import Approval, ApprovalStatus
from llm import compaction, context
from llm import gateway as model_gateway
from llm.types import Message
from runs import statements
from runs.models import OBSERVED, Run, Step, StepKind, StepStatus

MAX_RUNS = 2_048  # conversations kept per process (a few tens of kB each at 25 steps)


@dataclass
class _Conversation:
    upto: int = 0  # the last seq read into it
    messages: list[Message] = field(default_factory=list)
    results: dict[int, context.Result] = field(default_factory=dict)
    plan: compaction.Plan | None = None  # the compaction plan of the last call shaped from it
    summaries: dict[int, str] = field(default_factory=dict)  # per fold's call point (summary steps)


_kept: collections.OrderedDict = collections.OrderedDict()
_lock = threading.Lock()  # the worker runs steps of different runs on several threads


def kept_upto(run_id) -> int | None:
    """The last seq this process has in the run's conversation; None if it has none."""
    with _lock:
        kept = _kept.get(run_id)
        return kept.upto if kept is not None else None


def conversation(
    run: Run, window: list[Step], upto: int | None
) -> tuple[list[Message], dict[int, context.Result], dict[int, str]]:
    """The run's messages so far and, per tool message, its step (what the policy shapes); and
    the summaries of its folds, per fold's call point (runs/engine/summaries.py), which are no
    turn of the conversation.

    `window`: the claim's step window, read with `after=upto` (kept_upto's answer then), so it
    holds every step this process has not added yet; without a conversation kept here the
    history is read whole, once. In the claim's transaction with the run locked: no other worker
    adds steps meanwhile.
    """
    with _lock:
        kept = _kept.pop(run.pk, None)
    if kept is None or kept.upto != upto:
        kept = _Conversation(messages=[model_gateway.first_message(run)])
        steps = statements.steps_after(run, 0)
    else:
        steps = [s for s in window if s.seq > kept.upto]
    model_gateway.append_messages(kept.messages, steps, kept.results, decisions(run, steps))
    for step in steps:
        if step.kind == StepKind.SUMMARY and step.status == StepStatus.SUCCEEDED and step.result:
            kept.summaries[step.result["at"]] = step.result["text"]
    if steps:
        kept.upto = steps[-1].seq
    with _lock:
        _kept[run.pk] = kept
        while len(_kept) > MAX_RUNS:
            _kept.popitem(last=False)
    return list(kept.messages), dict(kept.results), dict(kept.summaries)


DECIDED: dict[str, str] = {
    ApprovalStatus.APPROVED: "approved",
    ApprovalStatus.CONSUMED: "approved",
    ApprovalStatus.DENIED: "rejected",
}


def decisions(run: Run, steps: list[Step]) -> dict[int, str]:
    """Per step seq, a person's decision on the approval of a tool call among `steps`, as its
    compact record names it ("approved by ravi"). Read once, with the step's turn: a finished
    step's approval never changes again. Not asked when the claim's read found no approval of
    the run decided by a person (the claim locks the run, so none is decided meanwhile)."""
    if run.claim_reads is not None and not run.claim_reads.people_decided:
        return {}
    ids = {s.pk: s.seq for s in steps if s.kind == StepKind.TOOL and s.status in OBSERVED}
    if not ids:
        return {}
    rows = Approval.objects.filter(
        run_id=run.pk, step_id__in=list(ids), status__in=list(DECIDED), decided_by__isnull=False
    ).values_list("step_id", "status", "decided_by__username")
    return {ids[step_id]: f"{DECIDED[status]} by {who}" for step_id, status, who in rows}


def plan_of(run_id) -> compaction.Plan | None:
    """The compaction plan of the run's last call shaped in this process, to resume from."""
    with _lock:
        kept = _kept.get(run_id)
        return kept.plan if kept is not None else None


def keep_plan(run_id, plan: compaction.Plan | None) -> None:
    """Keep the plan of the call just shaped, if it ends where the kept conversation ends (it was
    shaped from the whole of it)."""
    with _lock:
        kept = _kept.get(run_id)
        if kept is not None and plan is not None and plan.point == len(kept.messages):
            kept.plan = plan


def forget(run_id) -> None:
    """A run that ended needs no conversation any more."""
    with _lock:
        _kept.pop(run_id, None)
