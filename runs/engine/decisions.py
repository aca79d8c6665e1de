"""The engine's decisions: pure functions of plain, typed values (DESIGN.md sections 3-5).

Nothing here reads or writes the database, the clock or the network: the claim and the record
read what a decision needs into the frozen views below, call one function, and hand the decision
to the writer (runs/engine/writer.py), which applies it in the step's transaction. So every rule
of the engine is written once, here, and tested from tables of cases without PostgreSQL
(tests/runs/test_decisions.py).

    next_move(run, log, now)      what the claim does with a run: nothing, stop, park, recover
                                  the step in flight, answer or dispatch a proposed call, call
                                  the model, or finish
    after_unknown(attempt, now)   THE recovery table per effect class (section 5): what follows
                                  an attempt whose outcome is unknown, whether the worker saw the
                                  call end (a timeout) or was lost with it, or the provider said
                                  "in progress"
    model_turn(run, log)          the stop rules checked before a model call
    tool_turn(run)                the stop rules checked before a tool call
    authorization_turn(...)       a call to an OAuth-protected server without the user's
                                  connection: wait for the user to connect, or refuse
    after_unauthorized(...)       the server answered 401 to the call: wait, or refuse
    quota_turn(seq, admission)    whether the model call waits for its endpoint's shared quota
    timeout_backoff(base, draw)   how long an endpoint gets no call after one of its calls timed out
    output_turn(errors, refused, retries)
                                  a final answer: accept it, ask the model again, or fail the run
                                  (invalid_output)
    start_here(...)               regions: whether a run may start in this region
    budget_refusal(...)           regions: the tenant's day refused a reservation: the tenant's
                                  rule (stop or pause), or park for a slice from the home
    slice_ask(...), slice_give_back(...)
                                  regions: how much of the day a non-home region asks its home
                                  for, and how much it gives back
    authority_turn(...)           regions: whether this region's copy of the home's authority
                                  is fresh enough to act on (the tenant's revocation reach)

A decision is one of a small set of frozen types (`Decision`); each names what the writer does
and, where the step's status changes, the status it moves to. The writer's transitions are
checked against the maps in runs/models.py by tests/runs/test_decisions.py, so a decision the
map would refuse cannot be written here without a failing test.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Final, Literal

# The effect classes (tools.models.EffectClass values), spelled here so the table reads alone.
READ_ONLY, IDEMPOTENT, RECONCILABLE, UNSAFE = "read_only", "idempotent", "reconcilable", "unsafe"
# Classes whose unanswered attempt is looked up or sent again, so they wait out the settle window.
SETTLING = (IDEMPOTENT, RECONCILABLE)

MAX_MODEL_FAILURES = 5

# --- what the decisions read -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StepView:
    """One row of the step log, as much of it as a decision reads (runs/statements.step_heads)."""

    seq: int
    kind: str  # "model" | "tool" | "summary" (a fold's summary: never the agent's answer)
    status: str
    tool_name: str = ""
    tool_id: int | None = None
    args_digest: str = ""
    attempts: int = 0
    crashes: int = 0
    next_attempt_at: dt.datetime | None = None
    dispatched_at: dt.datetime | None = None
    has_tool_calls: bool = False  # a model step: its reply asked for tools
    output_refused: bool = False  # a model step: its final answer failed the version's output_schema
    error: str = ""  # a failed model step: what the provider answered
    endpoint_id: int | None = None  # a model step: the endpoint it went to (llm/fallback.py)
    error_class: str = ""  # a failed model step: rate_limited, server_error, timeout, ...


@dataclass(frozen=True, slots=True)
class ToolView:
    """The tool of a step in flight: what its recovery depends on."""

    effect: str
    max_attempts: int = 3
    timeout_seconds: float = 30.0
    settle_seconds: float = 0.0
    backoff_seconds: float = 1.0
    patience_seconds: float = 300.0


@dataclass(frozen=True, slots=True)
class RunView:
    """The run row as the claim locked it."""

    status: str
    cancel_requested: bool = False
    pause_requested: bool = False  # an operator's pause, taken at this step boundary
    deadline_at: dt.datetime | None = None
    leased: bool = False  # a lease token is set
    lease_expires_at: dt.datetime | None = None
    last_enqueued_at: dt.datetime | None = None
    step_count: int = 0
    tool_call_count: int = 0
    max_steps: int = 50
    max_tool_calls: int = 50
    engine_errors: int = 0  # consecutive steps whose claim or record raised


@dataclass(frozen=True, slots=True)
class Attempt:
    """A tool step's latest attempt whose outcome is not known (section 5)."""

    effect: str
    attempts: int
    max_attempts: int
    ended_at: dt.datetime  # when the call ended; lost with its worker: sent + timeout, the latest
    settle_seconds: float
    backoff_seconds: float
    lost: bool = False  # nobody saw the call end: the worker died or stalled past its lease
    in_progress: bool = False  # the provider answered that it has the request and is on it
    answered: bool = False  # "in progress" was the answer to the call itself, not to a lookup
    retry_after: float | None = None
    cancel_requested: bool = False
    patience_seconds: float = 300.0  # how long "in progress" is waited on past the settle window
    jitter: float = 1.0  # in [0.5, 1]: the caller draws it, so the table stays pure


# --- the decisions -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Quiet:
    """Nothing to do now: superseded message, a live lease elsewhere, a waiting or ended run."""

    why: str


@dataclass(frozen=True, slots=True)
class Cancel:
    pass


@dataclass(frozen=True, slots=True)
class Pause:
    """An operator asked to pause the run while a call was in flight: it is recorded, nothing new
    is dispatched, the run waits as a row (status paused) until someone resumes it."""


@dataclass(frozen=True, slots=True)
class Stop:
    reason: str  # runs.models.StopReason
    message: str


@dataclass(frozen=True, slots=True)
class FailRun:
    """The run fails with the cause a supervisor reads (the provider's answer, in full)."""

    error: str
    message: str


@dataclass(frozen=True, slots=True)
class Park:
    """The run waits as a row for a person: an approval, or an unknown outcome to resolve."""

    status: Literal["waiting_approval", "waiting_authorization", "needs_attention"]
    message: str


@dataclass(frozen=True, slots=True)
class Finish:
    """The model's last reply asked for no tool: the run succeeded."""


@dataclass(frozen=True, slots=True)
class CallModel:
    seq: int


@dataclass(frozen=True, slots=True)
class OpenToolCall:
    """A proposed, approved or retried tool call is next: the claim checks it with fresh rows
    (grants, policy, approval, replay, limits: tool_turn) before it is dispatched."""

    seq: int
    platform: bool  # answered by the platform itself from the run's rows (tools.offer.PLATFORM_TOOLS)


@dataclass(frozen=True, slots=True)
class WaitForRetry:
    """A retry is scheduled later than now: send the run's next message with this countdown."""

    seq: int
    countdown: float


@dataclass(frozen=True, slots=True)
class WaitForQuota:
    """The endpoint's shared quota (llm/quotas.py) has no room for the model call yet: nothing is
    reserved or dispatched; the run's next message is sent with this countdown."""

    seq: int
    countdown: float
    limit: str  # what held it: requests, tokens, fair_share, retry_after


@dataclass(frozen=True, slots=True)
class RecoverModel:
    """A model call lost with its worker: hold its reservation, mark it unknown, call again."""

    seq: int


@dataclass(frozen=True, slots=True)
class Poison:
    """The step crashed its worker (or the engine) too often: it fails, and so does the run.
    `step_status`: failed where the step cannot have had an effect, else outcome_unknown."""

    seq: int | None
    step_status: Literal["failed", "outcome_unknown"] | None
    step_error: str  # what the step records
    error: str  # what the run records


@dataclass(frozen=True, slots=True)
class Retry:
    """Send the call again (same idempotency key), now (`at` None) or at `at`; a reconcilable
    provider is asked first whether the key happened (`lookup_first`)."""

    seq: int
    at: dt.datetime | None = None
    lookup_first: bool = False
    why: str = ""


@dataclass(frozen=True, slots=True)
class WaitToSettle:
    """Wait as a row until the settle window has passed (section 5.1), then ask or retry."""

    seq: int
    until: dt.datetime
    why: str
    uncount_attempt: bool = False  # the attempt was answered "in progress": it did nothing


@dataclass(frozen=True, slots=True)
class AskPerson:
    """The step's outcome stays unknown: a supervisor resolves it (run needs_attention)."""

    seq: int
    why: str


@dataclass(frozen=True, slots=True)
class GiveUp:
    """A read-only call that never answered: the step fails, the model is told, the run goes on."""

    seq: int
    why: str


@dataclass(frozen=True, slots=True)
class WaitForAuthorization:
    """The call goes to a server that wants each user's own OAuth token, and this user has not
    connected it: the step waits (awaiting_authorization) and the run waits as a row
    (waiting_authorization) with the link to connect, holding no worker, message or reservation;
    it resumes when the user connects, and ends at its deadline like any run."""

    seq: int
    server: str


@dataclass(frozen=True, slots=True)
class Refuse:
    """The call is refused before anything is sent; the model is told why, the run goes on."""

    seq: int
    reason: str


@dataclass(frozen=True, slots=True)
class ConnectionView:
    """The run's user and the server of the call (connections.selectors.state_for)."""

    protected: bool  # the server asks for each user's own token
    active: bool = False
    revoked_at: dt.datetime | None = None  # the user's latest connection, revoked then


Decision = (
    Quiet
    | Cancel
    | Pause
    | Stop
    | FailRun
    | Park
    | Finish
    | CallModel
    | OpenToolCall
    | WaitForRetry
    | WaitForQuota
    | RecoverModel
    | Poison
    | Retry
    | WaitToSettle
    | AskPerson
    | GiveUp
    | WaitForAuthorization
    | Refuse
)

# The log's statuses, spelled as in runs.models.StepStatus.
DISPATCHING: Final = "dispatching"
OUTCOME_UNKNOWN: Final = "outcome_unknown"
AWAITING_APPROVAL: Final = "awaiting_approval"
AWAITING_AUTHORIZATION: Final = "awaiting_authorization"
READY = ("proposed", "approved", "retried")
SUCCEEDED: Final = "succeeded"
FAILED: Final = "failed"
WAITING = (
    "waiting_approval",
    "waiting_budget",
    "waiting_settle",
    "waiting_authorization",
    "needs_attention",
    "paused",
)
TERMINAL = ("succeeded", "failed", "cancelled", "stopped")


# --- the claim ---------------------------------------------------------------------------------


def next_move(
    run: RunView,
    log: list[StepView],
    now: dt.datetime,
    *,
    platform_tools: frozenset[str] = frozenset(),
    max_crashes: int = 3,
    tool: ToolView | None = None,
    jitter: float = 1.0,
) -> Decision:
    """What the claim does with the run, from its row and its step log (in seq order).

    A lease still live belongs to another worker; an expired one is taken over (the claim records
    that). `tool`: the tool of the tool step in flight, if there is one (`in_flight(log)`).
    """
    if run.status in TERMINAL or run.status in WAITING:
        return Quiet(f"run is {run.status}")
    if run.leased and run.lease_expires_at is not None and run.lease_expires_at > now:
        return Quiet("leased by a live worker")
    if run.cancel_requested:
        return Cancel()
    if run.pause_requested:
        lost = next((s for s in log if s.status == DISPATCHING and s.next_attempt_at is None), None)
        # A call lost with its worker is recovered first (the table below: it may be settled,
        # asked about or sent again with its key); a scheduled retry waits, kept, until resume.
        if lost is None:
            return Pause()
    if run.deadline_at is not None and now >= run.deadline_at:
        return Stop("deadline", "stopped: deadline passed")
    inflight = in_flight(log)
    if run.engine_errors >= max_crashes:
        return poison_for(
            inflight, tool, f"the engine failed {run.engine_errors} times at this step", engine=True
        )
    if inflight is not None:
        return _recover(inflight, tool, now, max_crashes=max_crashes, jitter=jitter)
    if any(s.kind == "tool" and s.status == OUTCOME_UNKNOWN for s in log):
        return Park("needs_attention", "waiting for a person to resolve an unknown outcome")
    if any(s.status == AWAITING_APPROVAL for s in log):
        return Park("waiting_approval", "waiting for approval")
    if any(s.status == AWAITING_AUTHORIZATION for s in log):
        return Park("waiting_authorization", "waiting for the user to connect a tool server")
    ready = next((s for s in log if s.kind == "tool" and s.status in READY), None)
    if ready is not None:
        return OpenToolCall(ready.seq, platform=ready.tool_name in platform_tools)
    last_model = next((s for s in reversed(log) if s.kind == "model" and s.status == SUCCEEDED), None)
    if last_model is not None and not last_model.has_tool_calls and not last_model.output_refused:
        return Finish()
    return CallModel(seq=(log[-1].seq if log else 0) + 1)


def in_flight(log: list[StepView]) -> StepView | None:
    """The step left `dispatching`, if any (at most one: a run dispatches one call at a time)."""
    return next((s for s in log if s.status == DISPATCHING), None)


def _recover(
    step: StepView, tool: ToolView | None, now: dt.datetime, *, max_crashes: int, jitter: float
) -> Decision:
    """A step left `dispatching`: a retry scheduled for later, one that is due, or a lost worker."""
    if step.next_attempt_at is not None:
        if step.next_attempt_at > now:
            return WaitForRetry(step.seq, (step.next_attempt_at - now).total_seconds())
        effect = tool.effect if tool else READ_ONLY
        if tool is not None and step.attempts >= tool.max_attempts:
            # A lookup that failed counts as an attempt too: a status endpoint that stays down
            # ends with a person, not in an endless loop of lookups.
            if effect == READ_ONLY:
                return GiveUp(step.seq, f"did not answer after {step.attempts} attempts")
            return AskPerson(step.seq, f"{step.attempts} attempts, outcome still unknown")
        return Retry(step.seq, lookup_first=effect == RECONCILABLE, why=f"retry due: {ACTION[effect]}")
    # Nobody recorded an outcome and nothing is scheduled: the worker was lost with the call.
    if step.crashes + 1 >= max_crashes:
        return poison_for(step, tool, f"worker died {step.crashes + 1} times during this step")
    if step.kind == "model" or tool is None:
        return RecoverModel(step.seq)
    sent = step.dispatched_at or now
    attempt = Attempt(
        effect=tool.effect,
        attempts=step.attempts,
        max_attempts=tool.max_attempts,
        ended_at=sent + dt.timedelta(seconds=tool.timeout_seconds),
        settle_seconds=tool.settle_seconds,
        backoff_seconds=tool.backoff_seconds,
        lost=True,
        jitter=jitter,
    )
    return after_unknown(step.seq, attempt, now)


def poison_for(step: StepView | None, tool: ToolView | None, error: str, *, engine: bool = False) -> Poison:
    if step is None:
        return Poison(None, None, error, f"the next step: {error}")
    no_effect = step.kind == "model" or tool is None or tool.effect == READ_ONLY
    if engine:
        run_error = f"step {step.seq}: {error}"
    else:
        run_error = f"step {step.seq} crashed its worker {step.crashes + 1} times"
    return Poison(step.seq, FAILED if no_effect else OUTCOME_UNKNOWN, error, run_error)


# --- the recovery table (DESIGN.md section 5) ----------------------------------------------------

ACTION = {
    READ_ONLY: "retry",
    IDEMPOTENT: "retry with the same key",
    RECONCILABLE: "ask the provider, then retry only if it did not happen",
    UNSAFE: "never retried automatically",
}


def after_unknown(seq: int, a: Attempt, now: dt.datetime) -> Retry | WaitToSettle | AskPerson | GiveUp:
    """What follows an attempt whose outcome is unknown. The only place the rules are written.

    | effect       | outcome unknown (timeout, reset, lost worker)                               |
    |--------------|------------------------------------------------------------------------------|
    | read_only    | retry with backoff until max_attempts, then the step fails (model told)      |
    | idempotent   | retry with the same key, not before the settle window has passed             |
    | reconcilable | ask the provider once the window has passed; retry only if it did not happen |
    | unsafe       | never retried: a person resolves it                                          |

    "In progress" (the provider has the request): asked again later, never re-sent, for at most
    `patience_seconds` past the settle window; then a person decides.
    """
    settled_at = a.ended_at + dt.timedelta(seconds=a.settle_seconds)
    if a.in_progress:
        if a.cancel_requested:
            return AskPerson(seq, "still in progress and the run was cancelled")
        if now >= settled_at + dt.timedelta(seconds=a.patience_seconds):
            return AskPerson(seq, f"still in progress {a.patience_seconds:g}s after its settle window")
        wait = a.retry_after if a.retry_after is not None else min(max(a.settle_seconds / 4, 1.0), 30.0)
        return WaitToSettle(
            seq,
            now + dt.timedelta(seconds=wait),
            "the provider says the call is still in progress; it is asked again, not re-sent",
            uncount_attempt=a.answered,
        )
    if a.effect == UNSAFE:
        return AskPerson(seq, "unsafe tool: never retried automatically")
    if a.attempts >= a.max_attempts:
        if a.effect == READ_ONLY:
            return GiveUp(seq, f"did not answer after {a.attempts} attempts")
        return AskPerson(seq, f"{a.attempts} attempts, outcome still unknown")
    if a.cancel_requested:
        if a.effect == READ_ONLY:
            return GiveUp(seq, "run cancelled")
        return AskPerson(seq, "outcome unknown and run cancelled")
    lookup = a.effect == RECONCILABLE
    if a.lost:
        if a.effect in SETTLING and now < settled_at:
            return WaitToSettle(
                seq,
                settled_at,
                f"attempt {a.attempts} was lost with its worker; settle window: the provider may make "
                f"it visible up to {a.settle_seconds:g}s after the call ended, and a status lookup or "
                "a retry before then proves nothing",
            )
        return Retry(
            seq,
            lookup_first=lookup,
            why=f"found in dispatching after its worker was lost: {ACTION[a.effect]}",
        )
    delay = (
        a.retry_after
        if a.retry_after is not None
        else a.backoff_seconds * 2 ** max(a.attempts - 1, 0) * a.jitter
    )
    retry_at = now + dt.timedelta(seconds=delay)
    if a.effect in SETTLING and settled_at > retry_at:
        return WaitToSettle(
            seq,
            settled_at,
            f"outcome unknown; settle window: the provider may make the call visible up to "
            f"{a.settle_seconds:g}s after it ended, and a status lookup or a retry before then proves nothing",
        )
    return Retry(seq, at=retry_at, lookup_first=lookup, why=f"retry in {delay:.1f}s")


# --- stop rules before a call ----------------------------------------------------------------------


def model_turn(
    run: RunView,
    log: list[StepView],
    *,
    user_active: bool,
    may_run_agent: bool,
    username: str = "",
    endpoint_id: int | None = None,
) -> Stop | FailRun | None:
    """Why the next model call must not be made, or None (checked before anything is reserved).

    `endpoint_id`: where the call would go (llm/fallback.choose). With fallbacks, the failures in
    a row that end the run are those of that endpoint: a fallback gets its own five tries, and the
    chain only moves down, so a run fails after at most five per endpoint. None counts them all.
    """
    if not user_active:
        # The run acts with its creator's authority, and a model call spends money on their behalf.
        return Stop("user_deactivated", "stopped: the user who started this run was deactivated")
    if not may_run_agent:
        # Starting a run needs run_agent, and so does every model turn.
        return Stop(
            "run_agent_revoked", f"stopped: {username} may no longer run this agent (run_agent revoked)"
        )
    if run.step_count >= run.max_steps:
        return Stop("max_steps", "stopped: max steps reached")
    failures, last_error = 0, ""
    for step in reversed(log):
        if step.kind == "summary":
            continue  # a fold's summary (runs/engine/summaries.py) is no turn of the agent's
        if step.kind != "model":
            break
        if step.status in (FAILED, OUTCOME_UNKNOWN) and (
            endpoint_id is None or step.endpoint_id in (endpoint_id, None)
        ):
            failures += 1
            last_error = last_error or step.error
    if failures >= MAX_MODEL_FAILURES:
        cause = f": {last_error}" if last_error else ""
        return FailRun(f"model call failed {failures} times in a row{cause}", "failed: model unavailable")
    return None


def tool_turn(run: RunView) -> Stop | None:
    """Why the next tool call must not be dispatched for the run's limits, or None."""
    if run.tool_call_count >= run.max_tool_calls:
        return Stop("max_tool_calls", "stopped: max tool calls")
    if run.step_count >= run.max_steps:
        return Stop("max_steps", "stopped: max steps reached")
    return None


# --- the user's own authority at the tool's server (connections/) -------------------------------


def authorization_turn(
    seq: int, connection: ConnectionView, *, server: str, run_created_at: dt.datetime
) -> WaitForAuthorization | Refuse | None:
    """Whether a call may go to its server on the user's connection, checked after the grants.

    | server             | the user's connection                 | the call                     |
    |--------------------|---------------------------------------|------------------------------|
    | not protected      | -                                     | goes on (None)               |
    | protected          | active                                | goes on, with the user's token |
    | protected          | revoked while this run lived          | refused: a disconnect denies |
    | protected          | none (or revoked before the run)      | waits for the user to connect |
    """
    if not connection.protected or connection.active:
        return None
    if connection.revoked_at is not None and connection.revoked_at >= run_created_at:
        return Refuse(seq, f"the user's connection to {server} was revoked; they must connect again")
    return WaitForAuthorization(seq, server)


def after_unauthorized(seq: int, *, presented: bool, server: str) -> WaitForAuthorization | Refuse:
    """The server answered 401 before the call ran (so nothing happened). With no token of the
    user's sent, it is the server saying it wants one: wait for the user to connect. A token it
    refused ends that connection: the call is refused (as is the next, until they reconnect)."""
    if presented:
        return Refuse(seq, f"{server} refused the user's token; the connection was revoked")
    return WaitForAuthorization(seq, server)


# --- the endpoint's shared quota before a model call ---------------------------------------------

# A quota wait longer than this is taken in several countdowns: the run asks again (one Redis
# round trip in its claim) rather than sit silent long enough for the sweeper to find its message
# lost (QUEUED_TOO_LONG_SECONDS).
LONGEST_QUOTA_COUNTDOWN = 10.0


def quota_turn(seq: int, wait_seconds: float, limit: str) -> WaitForQuota | None:
    """Whether the model call of step `seq` waits for its endpoint's quota (the limiter's answer:
    `wait_seconds` 0 is "go now")."""
    if wait_seconds <= 0:
        return None
    return WaitForQuota(seq, min(wait_seconds, LONGEST_QUOTA_COUNTDOWN), limit)


def timeout_backoff(base_seconds: float, draw: float) -> float:
    """How long no call goes to an endpoint after one of its calls timed out: its
    timeout_backoff_seconds times a factor from 1 to 2 (`draw`: uniform in [0, 1)).

    A server that timed out is busy (a one-slot llama.cpp server still generating the abandoned
    answer): an immediate retry queues behind that generation and times out in turn. The jitter
    spreads the runs that all waited on it, so they do not come back in one burst."""
    return max(0.0, base_seconds) * (1.0 + min(max(draw, 0.0), 1.0))


# --- a final answer against the version's output_schema (agents/output.py) -------------------------


def output_turn(errors: list[str], refused_before: int, retries: int) -> Literal["accept", "retry", "fail"]:
    """What follows a final answer with `errors` (empty: it validated), when `refused_before`
    answers of the run were refused already and the version allows `retries` more tries."""
    if not errors:
        return "accept"
    if refused_before < retries:
        return "retry"
    return "fail"


# --- regions: where a run may start, and the day spent from a slice (DESIGN.md section 9) --------

# The reasons a run parks in waiting_budget in a region that is not its tenant's home.
REGION_UNREACHABLE: Final = "budget region unreachable"
WAITING_FOR_SLICE: Final = "waiting for a budget slice from the home region"


def start_here(*, here: str, home: str, allowed: tuple[str, ...]) -> str | None:
    """None when a run may start in region `here`; else the refusal, naming where it may."""
    if not here or here in allowed:
        return None
    return (
        f"this tenant's runs may not start in region {here!r}: they start in "
        f"{', '.join(repr(r) for r in allowed)} (home {home!r})"
    )


def budget_refusal(
    *, scope: str, home_here: bool, link_up: bool, home_free_micros: int | None
) -> Literal["tenant_rule"] | tuple[Literal["park"], str]:
    """What a run does when the budget refused its reservation.

    A run's own budget, or a day at the tenant's home: the tenant's rule (stop, or pause to the
    next local day), as in one region. The tenant's day, or a user's day, in another region is its
    slice: with the home unreachable the run parks ("budget region unreachable") and resumes when
    a slice arrives; with the home reachable it parks for the slice being asked for, unless the
    home's last answer (for that day: the tenant's or the user's) said it had nothing left (then
    the day is spent everywhere: the tenant's rule). Never spend what was not granted.
    """
    if scope not in ("tenant_day", "user_day") or home_here:
        return "tenant_rule"
    if not link_up:
        return ("park", REGION_UNREACHABLE)
    if home_free_micros == 0:
        return "tenant_rule"
    return ("park", WAITING_FOR_SLICE)


def slice_ask(
    *,
    free_micros: int,
    size_micros: int,
    runs_waiting: bool,
    pending: bool,
    committed_micros: int = 0,
    waiting_micros: int = 0,
) -> int:
    """How much a non-home region asks its home for now (0: nothing).

    One request at a time (a pending one is sent again, same id, before any new one). What new
    runs may start on is the free room less what the runs admitted here are still expected to
    spend (`committed_micros`: admission's own sum, runs/admission.py); below half a slice of
    that it tops up to a whole slice, before it runs out: refills happen off the step path. Runs
    waiting here (admission's queue, or runs parked for a slice) ask for what their expected
    costs (`waiting_micros`, those of the queue) exceed that room by, in whole slices and at
    least one: a burst of runs is covered by one round trip, not one slice per keeper's pass,
    and a parked run's next call did not fit what is free. The home lends at most its share.
    """
    if pending:
        return 0
    room = free_micros - committed_micros
    if runs_waiting:
        short = waiting_micros - room
        return max(-(-short // size_micros), 1) * size_micros
    if room * 2 < size_micros:
        return size_micros - room
    return 0


def slice_give_back(
    *,
    free_micros: int,
    size_micros: int,
    day_over: bool,
    runs_waiting: bool = False,
    committed_micros: int = 0,
) -> int:
    """How much free room a non-home region returns to its home (0: nothing).

    A day that is over closes: all its free room goes back (reservations made before midnight
    settle on it later and what they leave is returned in turn). Today, nothing while runs wait
    here, and what the runs admitted here are still expected to spend (`committed_micros`) is
    not spare: admission let them start on it, and giving it back would park them mid-run. Of
    the rest, only room beyond two slices goes back, so the region keeps enough at hand not to
    ask again at once.
    """
    if free_micros <= 0:
        return 0
    if day_over:
        return free_micros
    if runs_waiting:
        return 0
    spare = free_micros - committed_micros
    return spare - 2 * size_micros if spare > 3 * size_micros else 0


AUTHORITY_STALE: Final = "authority copy stale"


def authority_turn(*, home_here: bool, age_seconds: float | None, reach_seconds: float) -> str | None:
    """None when this region may act on its copy of the home's authority (people, groups, grants,
    policies, kill switches); else why not (a run start is refused, a tool call waits).

    At home the copy is the original. Elsewhere the copy is as old as the newest heartbeat of the
    home it holds (every commit at home before that heartbeat is applied here): older than the
    tenant's revocation reach, or no heartbeat at all, and nothing is done on its word.
    """
    if home_here:
        return None
    if age_seconds is None:
        return f"{AUTHORITY_STALE}: no heartbeat from the home region has arrived"
    if age_seconds > reach_seconds:
        return (
            f"{AUTHORITY_STALE}: {age_seconds:.1f} s old, more than the tenant's revocation reach "
            f"of {reach_seconds:g} s"
        )
    return None
