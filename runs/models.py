from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.db import models

from core.ids import uuid7
from vault.fields import SealedJSONField, SealedTextField
from vault.keyed_search import KeyedWordsField


class RunStatus(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    WAITING_APPROVAL = "waiting_approval"
    WAITING_BUDGET = "waiting_budget"
    WAITING_SETTLE = "waiting_settle"  # a call's outcome is not knowable yet (DESIGN.md 5.1)
    # A tool call needs the user's own OAuth connection to its server, and there is none (connections/).
    WAITING_AUTHORIZATION = "waiting_authorization"
    NEEDS_ATTENTION = "needs_attention"
    PAUSED = (
        "paused"  # an operator's or a kill switch's hold, taken at a step boundary (runs/controls/pausing.py)
    )
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    STOPPED = "stopped"


TERMINAL = {RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.STOPPED}
WAITING = {
    RunStatus.WAITING_APPROVAL,
    RunStatus.WAITING_BUDGET,
    RunStatus.WAITING_SETTLE,
    RunStatus.WAITING_AUTHORIZATION,
    RunStatus.NEEDS_ATTENTION,
    RunStatus.PAUSED,
}
_END = {RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.STOPPED}

RUN_TRANSITIONS: dict[str, set[str]] = {
    # queued -> waiting_budget: not admitted yet (runs/admission.py); waiting_budget -> queued: admitted.
    RunStatus.QUEUED: {RunStatus.RUNNING, RunStatus.WAITING_BUDGET, RunStatus.PAUSED} | _END,
    RunStatus.RUNNING: WAITING | TERMINAL,
    RunStatus.WAITING_APPROVAL: {RunStatus.RUNNING, RunStatus.PAUSED} | _END,
    RunStatus.WAITING_BUDGET: {RunStatus.RUNNING, RunStatus.QUEUED, RunStatus.PAUSED} | _END,
    # A cancel never drops a call in flight: it waits for a person (runs.services.cancel_run).
    RunStatus.WAITING_SETTLE: {RunStatus.RUNNING, RunStatus.NEEDS_ATTENTION, RunStatus.PAUSED} | _END,
    RunStatus.NEEDS_ATTENTION: {RunStatus.RUNNING, RunStatus.PAUSED} | _END,
    # -> running: the user connected (runs/authorization_effects.py); ended by the deadline like any run.
    RunStatus.WAITING_AUTHORIZATION: {RunStatus.RUNNING, RunStatus.PAUSED} | _END,
    # Paused from any live status; resumed to where the run can go on (runs/controls/pausing.py): queued
    # if it never started, waiting_budget if never admitted, else running (the claim re-decides);
    # -> needs_attention: cancelled with a scheduled retry's outcome unknown (services.cancel_run).
    RunStatus.PAUSED: {
        RunStatus.RUNNING,
        RunStatus.QUEUED,
        RunStatus.WAITING_BUDGET,
        RunStatus.NEEDS_ATTENTION,
    }
    | _END,
    RunStatus.SUCCEEDED: set(),
    RunStatus.FAILED: set(),
    RunStatus.CANCELLED: set(),
    RunStatus.STOPPED: set(),
}


class StopReason(models.TextChoices):
    BUDGET_EXHAUSTED = "budget_exhausted"
    TENANT_BUDGET_EXHAUSTED = "tenant_budget_exhausted"
    MAX_STEPS = "max_steps"
    MAX_TOOL_CALLS = "max_tool_calls"
    DEADLINE = "deadline"
    LOOP_DETECTED = "loop_detected"
    APPROVAL_EXPIRED = "approval_expired"
    USER_DEACTIVATED = "user_deactivated"
    RUN_AGENT_REVOKED = "run_agent_revoked"


@dataclass(frozen=True)
class ClaimReads:
    """What a step's claim reads with the run's lock, in the same statement (runs.transitions
    .lock_run): each would otherwise be a statement of its own on every step."""

    policy_version: int | None  # the tenant's Cedar policies (approvals/cedar.py); None: it has none
    switches_on: bool  # a tool or endpoint kill switch of the tenant is on (runs/controls/kill_switches.py)
    groups: tuple[str, ...]  # the creator's tenant groups, by name (Cedar's principal parents)
    may_run_agent: bool  # the creator holds run_agent on the run's agent right now
    # A person has decided an approval of the run: only then does the conversation read who
    # (runs/engine/conversation.decisions), a statement most runs' model steps need not send.
    people_decided: bool = True
    # With regions: (the tenant's home or None, its revocation reach, the age in seconds of the
    # home's newest heartbeat here or None) (runs/authority_copy.py); None without regions.
    authority: tuple[str | None, float | None, float | None] | None = None


class Run(models.Model):
    # Set by lock_run(for_step=True) on the instance it returns; not a column.
    claim_reads: ClaimReads | None = None

    # Time-ordered: the id names the month the run was made in, the partition its steps and events
    # live in (history/partitions.py).
    id = models.UUIDField(primary_key=True, default=uuid7, editable=False)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="runs")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="runs")
    agent = models.ForeignKey("agents.AgentDefinition", on_delete=models.PROTECT, related_name="runs")
    version = models.ForeignKey("agents.AgentVersion", on_delete=models.PROTECT, related_name="runs")
    # What the run was started with and the caller's labels: content, sealed at rest with the run's
    # key (vault/fields.py). The run search reads `search_words` instead: keyed lexemes of their
    # words and values, made when the run is created (vault/keyed_search.py, runs/front/search.py).
    input = SealedJSONField(run="pk", tenant="tenant_id", empty=dict)
    metadata = SealedJSONField(run="pk", tenant="tenant_id", empty=dict, default=dict, blank=True)
    search_words = KeyedWordsField()
    limits = models.JSONField(default=dict)  # snapshot at admission, capped by the tenant
    status = models.CharField(
        max_length=24, choices=RunStatus.choices, default=RunStatus.QUEUED, db_index=True
    )
    stop_reason = models.CharField(max_length=32, choices=StopReason.choices, blank=True)
    # The error and the answer: content, sealed at rest with the run's key (vault/fields.py), as
    # its steps' are.
    error = SealedTextField(run="pk", tenant="tenant_id")
    final_output = SealedTextField(run="pk", tenant="tenant_id")
    cancel_requested = models.BooleanField(default=False)
    # An operator's pause (runs/controls/pausing.py): requested while a call is in flight, taken by the
    # record or the next claim at the step boundary; who, why and until when, kept while paused.
    pause_requested = models.BooleanField(default=False)
    paused_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    paused_at = models.DateTimeField(null=True, blank=True)
    pause_reason = models.TextField(blank=True)
    paused_until = models.DateTimeField(null=True, blank=True)
    paused_by_switch = models.ForeignKey(
        "runs.KillSwitch", null=True, blank=True, on_delete=models.SET_NULL, related_name="paused_runs"
    )  # turning the switch off resumes the runs it paused
    lease_token = models.UUIDField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    step_count = models.PositiveIntegerField(default=0)
    tool_call_count = models.PositiveIntegerField(default=0)
    model_call_count = models.PositiveIntegerField(default=0)
    loop_warnings = models.PositiveIntegerField(default=0)
    # No-progress detection's running counts (runs/engine/loops.py): kept with the run so that a
    # step never rescans the log; {} until the first tool call has its outcome.
    loop_state = models.JSONField(default=dict, blank=True)
    # Consecutive claims whose code raised (a bug, a constraint): counted like worker deaths, so a
    # run whose step keeps raising fails with the exception's text instead of looping.
    engine_errors = models.PositiveIntegerField(default=0)
    revealed_tools = models.JSONField(default=list, blank=True)  # found through search_tools
    idempotency_key = models.CharField(max_length=200, null=True, blank=True)
    request_hash = models.CharField(max_length=64, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    deadline_at = models.DateTimeField(null=True, blank=True)
    resume_at = models.DateTimeField(null=True, blank=True)  # waiting_budget / waiting_settle: wake-up time
    # Admission (runs/admission.py): when the run was let start (null while it waits to be), and
    # what it was expected to cost then; admitted runs' unspent expectations are kept free.
    admitted_at = models.DateTimeField(null=True, blank=True)
    expected_cost_micros = models.BigIntegerField(default=0)
    last_enqueued_at = models.DateTimeField(null=True, blank=True)
    event_seq = models.PositiveIntegerField(default=0)  # the seq of the run's latest event
    # The hash chain over the run's events (core/chain.py): the chain hash of its latest event
    # (zero bytes before the first), and the head before the latest write, which the statement
    # that writes events returns to chain them from (runs/statements.py).
    chain_head = models.BinaryField(default=bytes(32))
    chain_prev = models.BinaryField(default=bytes(32))
    # An evaluation's run (evals/, docs/evaluations.md): its tools are answered from recordings
    # (RunReplay), nothing leaves the platform, and it is left out of the tenant's usage, run
    # search and metrics of real work.
    evaluation = models.BooleanField(default=False)
    # Which arm of its alias's canary the run took (agents.selectors.resolve_arm): "stable",
    # "canary", or "" (no canary, or a version asked for by number). Kept for the run's life.
    arm = models.CharField(max_length=8, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "created_by", "idempotency_key"],
                condition=models.Q(idempotency_key__isnull=False),
                name="uniq_run_idempotency_key",
            ),
        ]
        indexes = [
            models.Index(fields=["tenant", "status"]),
            # No index holds lease_expires_at, last_enqueued_at or the counters: a claim and a
            # record change them on every step, and PostgreSQL updates a row in place, without
            # touching its twenty indexes (one a GIN over its search words), only when no
            # indexed column changed (a HOT update; migration 0017). The sweeper finds expired
            # leases among the running runs through the status index.
            # The sweeper's pass over pauses given an end (runs/controls/pausing.resume_due): empty most days.
            models.Index(
                fields=["paused_until"],
                name="run_pause_ends",
                condition=models.Q(status="paused", paused_until__isnull=False),
            ),
        ]
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return str(self.id)

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL


class StepKind(models.TextChoices):
    MODEL = "model"
    TOOL = "tool"
    # A model's summary of a compaction's fold (runs/engine/summaries.py): a call of its own,
    # never a turn of the conversation.
    SUMMARY = "summary"


class StepStatus(models.TextChoices):
    PROPOSED = "proposed"
    DENIED = "denied"
    AWAITING_APPROVAL = "awaiting_approval"
    AWAITING_AUTHORIZATION = "awaiting_authorization"  # the user must connect the tool's server first
    APPROVED = "approved"
    REJECTED = "rejected"
    EXPIRED = "expired"
    DISPATCHING = "dispatching"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    OUTCOME_UNKNOWN = "outcome_unknown"
    RESOLVED_SUCCEEDED = "resolved_succeeded"
    RESOLVED_FAILED = "resolved_failed"
    RETRIED = "retried"
    SKIPPED = "skipped"


# Statuses whose observation the model can be given.
OBSERVED = {
    StepStatus.DENIED,
    StepStatus.REJECTED,
    StepStatus.EXPIRED,
    StepStatus.SUCCEEDED,
    StepStatus.FAILED,
    StepStatus.RESOLVED_SUCCEEDED,
    StepStatus.RESOLVED_FAILED,
    StepStatus.SKIPPED,
}
# Tool steps the engine may dispatch next.
READY = {StepStatus.PROPOSED, StepStatus.APPROVED, StepStatus.RETRIED}
# Steps whose status will still change: what the claim reads besides the log's tail
# (runs/statements.step_window), through a partial index so its cost does not grow with the run.
OPEN = READY | {
    StepStatus.AWAITING_APPROVAL,
    StepStatus.AWAITING_AUTHORIZATION,
    StepStatus.DISPATCHING,
    StepStatus.OUTCOME_UNKNOWN,
}

STEP_TRANSITIONS: dict[str, set[str]] = {
    # -> succeeded / failed without dispatching: a replay of an identical call, or a platform
    # tool answered from the run's own rows (a malformed call to one fails, and the model is told).
    # -> awaiting_authorization: the user has no connection to the tool's OAuth-protected server
    # (from approved or retried too, and from dispatching when the server's 401 says so first);
    # back to proposed once they connect, so every check (an approval too) is made again.
    StepStatus.PROPOSED: {
        StepStatus.DENIED,
        StepStatus.AWAITING_APPROVAL,
        StepStatus.AWAITING_AUTHORIZATION,
        StepStatus.DISPATCHING,
        StepStatus.SUCCEEDED,
        StepStatus.FAILED,
        StepStatus.SKIPPED,
    },
    StepStatus.AWAITING_APPROVAL: {
        StepStatus.APPROVED,
        StepStatus.REJECTED,
        StepStatus.EXPIRED,
        StepStatus.SKIPPED,
    },
    StepStatus.AWAITING_AUTHORIZATION: {StepStatus.PROPOSED, StepStatus.SKIPPED},
    StepStatus.APPROVED: {
        StepStatus.DISPATCHING,
        StepStatus.DENIED,
        StepStatus.SKIPPED,
        StepStatus.AWAITING_AUTHORIZATION,
    },
    # -> denied: the user's identity provider refused a token for the call (authority/), so
    # nothing was sent.
    StepStatus.DISPATCHING: {
        StepStatus.SUCCEEDED,
        StepStatus.FAILED,
        StepStatus.OUTCOME_UNKNOWN,
        StepStatus.DISPATCHING,
        StepStatus.DENIED,
        StepStatus.AWAITING_AUTHORIZATION,
    },
    StepStatus.OUTCOME_UNKNOWN: {
        StepStatus.RESOLVED_SUCCEEDED,
        StepStatus.RESOLVED_FAILED,
        StepStatus.RETRIED,
    },
    # -> denied: a person asked for a retry, and the checks at dispatch refused it (a revoked grant).
    StepStatus.RETRIED: {
        StepStatus.DISPATCHING,
        StepStatus.DENIED,
        StepStatus.SKIPPED,
        StepStatus.AWAITING_AUTHORIZATION,
    },
}


class Step(models.Model):
    """One model call or one tool call. (run, seq) is unique: a second claim cannot add a twin."""

    # No index of its own: (run, seq) is unique, and its index serves every lookup by run.
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="steps", db_index=False)
    seq = models.PositiveIntegerField()
    kind = models.CharField(max_length=8, choices=StepKind.choices)
    status = models.CharField(max_length=24, choices=StepStatus.choices)
    parent_seq = models.PositiveIntegerField(null=True, blank=True)  # tool step: model step that proposed it
    tool = models.ForeignKey(
        "tools.Tool", null=True, blank=True, on_delete=models.PROTECT, related_name="steps"
    )
    tool_name = models.CharField(max_length=200, blank=True)
    call_id = models.CharField(max_length=200, blank=True)
    # Content (what a model, a tool or a person said) is sealed at rest with the run's key
    # (vault/fields.py): erasing the run destroys the key, and with it every copy, backups included.
    arguments = SealedJSONField(blank=True)
    args_digest = models.CharField(max_length=64, blank=True)
    idempotency_key = models.CharField(max_length=200, blank=True)
    request = SealedJSONField(blank=True)  # redacted
    result = SealedJSONField(blank=True)  # redacted, full
    observation = SealedTextField()  # what the model is given
    error = SealedTextField()
    usage = models.JSONField(null=True, blank=True)
    cost_micros = models.BigIntegerField(default=0)
    reserved_micros = models.BigIntegerField(default=0)
    attempts = models.PositiveIntegerField(default=0)
    crashes = models.PositiveIntegerField(default=0)  # attempts that ended with no recorded outcome
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    replayed_from_seq = models.PositiveIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    dispatched_at = models.DateTimeField(null=True, blank=True)  # when the latest attempt was sent
    finished_at = models.DateTimeField(null=True, blank=True)  # when the call's outcome was known
    resolved_at = models.DateTimeField(null=True, blank=True)  # when a person resolved an unknown outcome
    resolution = SealedTextField()  # what they decided, and why
    # A model step: the endpoint it was sent to (the primary or a fallback: llm/fallback.py), and
    # the class of its failure (rate_limited, server_error, timeout, context_too_long; "" answered).
    model_endpoint = models.ForeignKey(
        "llm.ModelEndpoint", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    error_class = models.CharField(max_length=20, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["run", "seq"], name="uniq_step_seq")]
        indexes = [
            models.Index(
                fields=["run", "seq"],
                name="step_open",
                condition=models.Q(
                    status__in=[
                        "proposed",
                        "approved",
                        "retried",
                        "awaiting_approval",
                        "awaiting_authorization",
                        "dispatching",
                        "outcome_unknown",
                    ]
                ),
            )
        ]
        ordering = ["run", "seq"]

    def __str__(self) -> str:
        return f"{self.run_id}#{self.seq} {self.kind} {self.tool_name}"

    @property
    def duration_ms(self) -> int | None:
        if self.started_at and self.finished_at:
            return int((self.finished_at - self.started_at).total_seconds() * 1000)
        return None


# Event data the platform writes about its own state, never about what was said (docs/history.md,
# "Content and skeleton"): statuses, tools, agents, policies, costs, approvals and holds, identity
# assertions' jti and parties, content digests, and what a removal removed. Kept in the clear in
# `RunEvent.skeleton` for the skeleton's period; every other key is content.
EVENT_SKELETON = frozenset(
    {
        "from",
        "to",
        "step_kind",
        "tool",
        "content",
        "agent",
        "version",
        "alias",
        "expected_cost_micros",
        "admission",
        "cost_micros",
        "effect_class",
        "outcome",
        "policies",
        "policy_set",
        "policy_version",
        "decision",
        "scope",
        "approval",
        "certificate",
        "hold",
        # an identity assertion presented (runs/engine/tool_step.py): who, to whom, its jti
        "jti",
        "subject",
        "audience",
        "token_subject",
        # recovery's findings and actions, a compaction's place, a circuit's state, the limit a
        # call waited on, the operators' bulk action (filtered on by the sweeper and the engine)
        "found",
        "action",
        "state",
        "limit",
        "alone",
        "bulk_action",
        "at",
        "first_step",
        "last_step",
        "region_reason",
        # a removal (history/content.py): why, and which items went
        "note",
        "why",
        "run",
        "steps",
        "events",
        "approvals",
        "artifacts",
    }
)


class RunEvent(models.Model):
    """Append-only timeline of everything that happened to a run.

    `seq` numbers a run's events 1, 2, 3, ... (runs.transitions.write_events): the API shows it as
    the event's id, so a run's timeline says nothing about other runs' activity.
    """

    # No index of its own: (run, seq) is unique, and its index serves every lookup by run. A step
    # writes about three events, and each index is one more write per event (docs/performance.md).
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="events", db_index=False)
    seq = models.PositiveIntegerField()
    at = models.DateTimeField(auto_now_add=True, db_index=True)
    kind = models.CharField(max_length=40)
    step_seq = models.PositiveIntegerField(null=True, blank=True)
    # Indexed only where set (a person's events: the engine's own have no actor), which is all
    # that deleting a user needs to find.
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        db_index=False,
    )
    # What was said: content, sealed at rest with the run's key (vault/fields.py). `skeleton`: the
    # data's keys about the platform's own state (EVENT_SKELETON), copied in the clear when the
    # event is written: what the database filters on, and what stays once the content is removed
    # or its key destroyed.
    message = SealedTextField()
    data = SealedJSONField(empty=dict, blank=True)
    skeleton = models.JSONField(default=dict, blank=True)
    # The chain (core/chain.py): SHA-256 of message and data, kept when they are erased; and the
    # event's chain hash over the previous one's, its seq, its skeleton fields and that digest.
    content_digest = models.CharField(max_length=64, blank=True)
    chain_hash = models.BinaryField(null=True, blank=True)

    class Meta:
        ordering = ["id"]
        constraints = [models.UniqueConstraint(fields=["run", "seq"], name="uniq_run_event_seq")]
        indexes = [
            models.Index(fields=["actor"], name="event_actor", condition=models.Q(actor__isnull=False)),
        ]

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"

    @property
    def details(self) -> dict:
        """What the API, the admin and exports show: the data, or its skeleton once the content went."""
        return {**self.skeleton, **self.data} if isinstance(self.data, dict) else dict(self.skeleton)


def skeleton_of(data) -> dict:
    """The keys of an event's data that are its skeleton (EVENT_SKELETON)."""
    if not isinstance(data, dict):
        return {}
    return {key: value for key, value in data.items() if key in EVENT_SKELETON}


class RunReplay(models.Model):
    """How an evaluation's run is answered: the recorded tool results its calls are answered from
    (tools/replay.py), what a call the recordings do not cover gets, and the evaluation's budget
    account its calls reserve on instead of the tenant's day (budgets.services.reserve_on).

    A row of its own, not columns of the run: the engine reads it only for evaluation runs.
    """

    class Uncovered(models.TextChoices):
        ERROR = "error"  # the call fails with an error the model is shown
        NEAREST = "nearest"  # the nearest recording of the same tool answers it

    run = models.OneToOneField(Run, on_delete=models.CASCADE, primary_key=True, related_name="replay")
    recordings = models.JSONField(default=list, blank=True)
    uncovered = models.CharField(max_length=8, choices=Uncovered.choices, default=Uncovered.ERROR)
    budget_account = models.ForeignKey(
        "budgets.BudgetAccount", on_delete=models.PROTECT, related_name="+", null=True, blank=True
    )

    def __str__(self) -> str:
        return f"replay of {self.run_id}"


# An operator's controls over runs (runs/controls/pausing.py, runs/controls/kill_switches.py), in a module of their own.
from runs.controls.models import BulkAction, KillSwitch, KillSwitchChange  # noqa: E402, F401
