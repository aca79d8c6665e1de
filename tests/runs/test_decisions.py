"""The engine's decision table, from tables of cases, without a database (runs/engine/decisions.py).

Every effect class x outcome x attempt x settle window gives one decision; each decision the
writer applies moves a step or a run only along the transition maps of runs/models.py.
"""

from __future__ import annotations

import datetime as dt
import itertools

import pytest

from runs.engine import decisions as d
from runs.models import RUN_TRANSITIONS, STEP_TRANSITIONS

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
SECOND = dt.timedelta(seconds=1)
EFFECTS = (d.READ_ONLY, d.IDEMPOTENT, d.RECONCILABLE, d.UNSAFE)


def attempt(effect, **changes) -> d.Attempt:
    base = dict(
        effect=effect,
        attempts=1,
        max_attempts=3,
        ended_at=NOW,
        settle_seconds=60,
        backoff_seconds=1.0,
        jitter=1.0,
    )
    return d.Attempt(**{**base, **changes})


# (effect, lost, attempts, seconds since the call ended, cancelled) -> decision type, lookup first
CASES = []
for effect, lost, attempts, since, cancelled in itertools.product(
    EFFECTS, (False, True), (1, 3), (0, 30, 61), (False, True)
):
    if effect == d.UNSAFE:
        expected = d.AskPerson
    elif attempts >= 3 or cancelled:
        expected = d.GiveUp if effect == d.READ_ONLY else d.AskPerson
    elif effect in d.SETTLING and since < 60:
        expected = d.WaitToSettle  # a lookup or a retry inside the window proves nothing
    else:
        expected = d.Retry
    CASES.append((effect, lost, attempts, since, cancelled, expected))


@pytest.mark.parametrize("effect,lost,attempts,since,cancelled,expected", CASES)
def test_the_recovery_table(effect, lost, attempts, since, cancelled, expected):
    a = attempt(
        effect, lost=lost, attempts=attempts, ended_at=NOW - since * SECOND, cancel_requested=cancelled
    )
    decision = d.after_unknown(7, a, NOW)
    assert type(decision) is expected
    assert decision.seq == 7
    if isinstance(decision, d.Retry):
        assert decision.lookup_first == (effect == d.RECONCILABLE)  # never retried before asking
        if lost:
            assert decision.at is None  # the worker is gone: nobody is waiting out a backoff
        else:
            assert decision.at == NOW + dt.timedelta(seconds=2 ** (attempts - 1))
    if isinstance(decision, d.WaitToSettle):
        assert decision.until == NOW - since * SECOND + 60 * SECOND


def test_a_retry_after_from_the_provider_is_the_delay():
    decision = d.after_unknown(3, attempt(d.READ_ONLY, retry_after=12.5), NOW)
    assert decision == d.Retry(3, at=NOW + dt.timedelta(seconds=12.5), why=decision.why)


def test_a_backoff_shorter_than_the_window_waits_for_the_window_not_the_backoff():
    decision = d.after_unknown(3, attempt(d.IDEMPOTENT, settle_seconds=5, backoff_seconds=10), NOW)
    assert isinstance(decision, d.Retry) and decision.at == NOW + 10 * SECOND
    decision = d.after_unknown(3, attempt(d.IDEMPOTENT, settle_seconds=50, backoff_seconds=10), NOW)
    assert decision == d.WaitToSettle(3, NOW + 50 * SECOND, decision.why)


@pytest.mark.parametrize("effect", EFFECTS)
@pytest.mark.parametrize("answered", [False, True])
def test_in_progress_is_asked_again_never_resent_then_a_person_decides(effect, answered):
    a = attempt(effect, in_progress=True, answered=answered, retry_after=5, patience_seconds=600)
    waiting = d.after_unknown(4, a, NOW)
    assert waiting == d.WaitToSettle(4, NOW + 5 * SECOND, waiting.why, uncount_attempt=answered)
    late = NOW + (60 + 600) * SECOND
    assert isinstance(d.after_unknown(4, a, late), d.AskPerson)
    assert isinstance(
        d.after_unknown(4, attempt(effect, in_progress=True, cancel_requested=True), NOW), d.AskPerson
    )


def run(**changes) -> d.RunView:
    return d.RunView(**{"status": "running", **changes})


def step(seq, kind="tool", status="succeeded", **changes) -> d.StepView:
    return d.StepView(seq=seq, kind=kind, status=status, **changes)


MODEL_WITH_CALLS = step(1, "model", has_tool_calls=True)


@pytest.mark.parametrize(
    "view,log,expected",
    [
        (run(status="succeeded"), [], d.Quiet),
        (run(status="waiting_approval"), [], d.Quiet),
        (run(status="paused"), [], d.Quiet),
        (run(leased=True, lease_expires_at=NOW + SECOND), [], d.Quiet),
        (run(leased=True, lease_expires_at=NOW - SECOND), [], d.CallModel),  # taken over
        (run(cancel_requested=True), [MODEL_WITH_CALLS, step(2, status="proposed")], d.Cancel),
        (run(deadline_at=NOW), [], d.Stop),
        (run(), [MODEL_WITH_CALLS, step(2, status="outcome_unknown")], d.Park),
        (run(), [MODEL_WITH_CALLS, step(2, status="awaiting_approval")], d.Park),
        (run(status="waiting_authorization"), [], d.Quiet),
        (run(), [MODEL_WITH_CALLS, step(2, status="awaiting_authorization")], d.Park),
        (run(), [MODEL_WITH_CALLS, step(2, status="succeeded"), step(3, status="proposed")], d.OpenToolCall),
        (run(), [MODEL_WITH_CALLS, step(2)], d.CallModel),
        (run(), [MODEL_WITH_CALLS, step(2), step(3, "model")], d.Finish),
        (run(), [], d.CallModel),
        (run(), [step(1, "model", "dispatching")], d.RecoverModel),
        (run(), [step(1, "model", "dispatching", crashes=2)], d.Poison),
        (run(engine_errors=3), [], d.Poison),
        # An operator's pause, at the step boundary: after cancel, before anything is dispatched.
        (run(pause_requested=True), [MODEL_WITH_CALLS, step(2, status="proposed")], d.Pause),
        (run(pause_requested=True), [], d.Pause),
        (run(pause_requested=True, cancel_requested=True), [], d.Cancel),
        (run(pause_requested=True, leased=True, lease_expires_at=NOW + SECOND), [], d.Quiet),
        (run(pause_requested=True, deadline_at=NOW), [], d.Pause),  # the pause does not count
        # a call lost with its worker is recovered first; a scheduled retry waits for the resume
        (run(pause_requested=True), [step(1, "model", "dispatching")], d.RecoverModel),
        (
            run(pause_requested=True),
            [MODEL_WITH_CALLS, step(2, status="dispatching", next_attempt_at=NOW + SECOND)],
            d.Pause,
        ),
    ],
)
def test_next_move(view, log, expected):
    assert type(d.next_move(view, log, NOW, max_crashes=3)) is expected


def test_a_platform_tool_is_answered_by_the_platform():
    log = [MODEL_WITH_CALLS, step(2, status="proposed", tool_name="read_result")]
    assert d.next_move(run(), log, NOW, platform_tools=frozenset({"read_result"})) == d.OpenToolCall(
        2, platform=True
    )


def test_a_step_in_flight_follows_the_recovery_table_with_its_tool():
    tool = d.ToolView(effect=d.IDEMPOTENT, timeout_seconds=10, settle_seconds=60)
    lost = step(2, status="dispatching", dispatched_at=NOW - 20 * SECOND, attempts=1)
    decision = d.next_move(run(), [MODEL_WITH_CALLS, lost], NOW, tool=tool)
    assert decision == d.WaitToSettle(2, NOW + 50 * SECOND, decision.why)  # sent + timeout + settle
    due = step(2, status="dispatching", next_attempt_at=NOW - SECOND)
    recon = d.ToolView(effect=d.RECONCILABLE)
    assert d.next_move(run(), [MODEL_WITH_CALLS, due], NOW, tool=recon).lookup_first
    later = step(2, status="dispatching", next_attempt_at=NOW + 5 * SECOND)
    assert d.next_move(run(), [MODEL_WITH_CALLS, later], NOW, tool=tool) == d.WaitForRetry(2, 5.0)


def test_the_stop_rules_before_a_model_call():
    assert d.model_turn(run(), [], user_active=False, may_run_agent=True).reason == "user_deactivated"
    assert d.model_turn(run(), [], user_active=True, may_run_agent=False).reason == "run_agent_revoked"
    assert (
        d.model_turn(run(step_count=50, max_steps=50), [], user_active=True, may_run_agent=True).reason
        == "max_steps"
    )
    failures = [step(i, "model", "failed", error=f"HTTP 400: bad {i}") for i in range(1, 6)]
    failed = d.model_turn(run(), failures, user_active=True, may_run_agent=True)
    assert isinstance(failed, d.FailRun) and failed.error.endswith("HTTP 400: bad 5")
    assert d.model_turn(run(), failures[:4], user_active=True, may_run_agent=True) is None
    assert d.tool_turn(run(tool_call_count=50, max_tool_calls=50)).reason == "max_tool_calls"


# What the writer moves a step to for each decision (runs/engine/writer.py), and from where.
STEP_MOVES = {
    d.AskPerson: [("dispatching", "outcome_unknown")],
    d.GiveUp: [("dispatching", "failed")],
    d.Poison: [("dispatching", "failed"), ("dispatching", "outcome_unknown")],
    # a denial (proposed, or approved and re-checked), a replay, a platform tool's answer
    "deny": [("proposed", "denied"), ("approved", "denied"), ("retried", "denied")],
    "replay": [("proposed", "succeeded")],
    "answered": [("proposed", "succeeded"), ("proposed", "failed")],
    # the user has no connection to the tool's OAuth-protected server: from every open call, and
    # from dispatching when the server's 401 said so first; back to proposed once they connect
    d.WaitForAuthorization: [
        ("proposed", "awaiting_authorization"),
        ("approved", "awaiting_authorization"),
        ("retried", "awaiting_authorization"),
        ("dispatching", "awaiting_authorization"),
    ],
    "resume_connected": [("awaiting_authorization", "proposed")],
    # refused at the claim (a denial, above), or by the server's 401 to the user's token
    d.Refuse: [("dispatching", "failed")],
}
RUN_MOVES = {
    d.Park: [
        ("running", "waiting_approval"),
        ("running", "waiting_authorization"),
        ("running", "needs_attention"),
    ],
    d.WaitForAuthorization: [("running", "waiting_authorization")],
    "resume_connected": [("waiting_authorization", "running")],
    "deadline": [("waiting_authorization", "stopped")],
    d.WaitToSettle: [("running", "waiting_settle")],
    d.AskPerson: [("running", "needs_attention")],
    d.Cancel: [("queued", "cancelled"), ("running", "cancelled")],
    d.Stop: [("queued", "stopped"), ("running", "stopped")],
    d.FailRun: [("running", "failed")],
    d.Finish: [("running", "succeeded")],
    d.Poison: [("running", "failed")],
    d.Pause: [("running", "paused")],
    # runs/controls/pausing.py: a pause no worker holds, from every live status; a resume, to where it goes on
    "pause_run": [
        (old, "paused")
        for old in (
            "queued",
            "running",
            "waiting_approval",
            "waiting_budget",
            "waiting_settle",
            "waiting_authorization",
            "needs_attention",
        )
    ],
    "resume_run": [("paused", "running"), ("paused", "queued"), ("paused", "waiting_budget")],
    "cancel_paused": [("paused", "cancelled"), ("paused", "needs_attention")],
}


def _names(moves: dict) -> list[str]:
    return [getattr(key, "__name__", key) for key in moves]


@pytest.mark.parametrize("decision,moves", list(STEP_MOVES.items()), ids=_names(STEP_MOVES))
def test_every_step_move_the_writer_makes_is_in_the_map(decision, moves):
    for old, new in moves:
        assert new in STEP_TRANSITIONS[old], f"{decision}: {old} -> {new} is refused by the map"


@pytest.mark.parametrize("decision,moves", list(RUN_MOVES.items()), ids=_names(RUN_MOVES))
def test_every_run_move_the_writer_makes_is_in_the_map(decision, moves):
    for old, new in moves:
        assert new in RUN_TRANSITIONS[old], f"{decision}: {old} -> {new} is refused by the map"


def test_a_denial_can_start_from_every_status_next_move_offers_as_an_open_call():
    assert {old for old, _ in STEP_MOVES["deny"]} == set(d.READY)


CONNECTED = d.ConnectionView(protected=True, active=True)


@pytest.mark.parametrize(
    "connection,expected",
    [
        (d.ConnectionView(protected=False), None),
        (CONNECTED, None),
        (d.ConnectionView(protected=True), d.WaitForAuthorization(2, "cards")),
        # revoked while the run lived: a disconnect denies the call
        (d.ConnectionView(protected=True, revoked_at=NOW + SECOND), d.Refuse),
        # revoked before the run began: the run waits for a new connection, like one never made
        (d.ConnectionView(protected=True, revoked_at=NOW - SECOND), d.WaitForAuthorization(2, "cards")),
    ],
)
def test_the_authorization_table(connection, expected):
    decision = d.authorization_turn(2, connection, server="cards", run_created_at=NOW)
    if isinstance(expected, type):
        assert isinstance(decision, expected) and "revoked" in decision.reason
    else:
        assert decision == expected


def test_a_401_waits_for_a_connection_unless_the_users_own_token_was_refused():
    assert d.after_unauthorized(2, presented=False, server="cards") == d.WaitForAuthorization(2, "cards")
    refused = d.after_unauthorized(2, presented=True, server="cards")
    assert isinstance(refused, d.Refuse) and "refused the user's token" in refused.reason


@pytest.mark.parametrize(
    "wait,limit,expected",
    [
        (0.0, "", None),
        (0.0, "unavailable", None),  # the limiter could not be asked: the call goes
        (0.25, "requests", d.WaitForQuota(4, 0.25, "requests")),
        (3.0, "fair_share", d.WaitForQuota(4, 3.0, "fair_share")),
        # A long Retry-After is waited in countdowns the sweeper does not take for a lost message.
        (90.0, "retry_after", d.WaitForQuota(4, d.LONGEST_QUOTA_COUNTDOWN, "retry_after")),
    ],
)
def test_a_model_call_waits_for_its_endpoints_quota_only_when_told(wait, limit, expected):
    assert d.quota_turn(4, wait, limit) == expected
