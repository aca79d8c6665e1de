"""The run page: status, budget, steps and events; cancelling; resolving unknown outcomes."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import LogEntry
from django.utils.html import escape

from approvals.models import ApprovalStatus
from runs.approval_effects import decide_approval
from runs.engine import advance
from runs.models import Run, RunStatus, Step, StepStatus
from runs.services import start_run
from tenants.models import Tenant
from tests.admin.helpers import make_supervisor, park_on_approval
from tests.conftest import drive
from tools.models import Tool

RUNS = "/admin/runs/run/"


def run_url(run_id, suffix: str = "change/") -> str:
    return f"{RUNS}{run_id}/{suffix}"


def messages_of(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]


@pytest.fixture
def unknown_step(acme) -> Step:
    """An unsafe echo call whose worker died after committing `dispatching`: outcome unknown."""
    echo = acme.tools["echo"]
    Tool.objects.filter(pk=echo.pk).update(approval_policy="never", effect_class="unsafe")
    run, _ = start_run(user=acme.asha, agent="refunder", input={"case": "lost"})
    advance(run.pk)  # the model step proposes the echo call
    step = Step.objects.get(run=run, seq=2)
    # What a worker leaves behind when it dies right after marking the step dispatching.
    Step.objects.filter(pk=step.pk).update(status=StepStatus.DISPATCHING, attempts=1)
    advance(run.pk)
    step.refresh_from_db()
    assert step.status == StepStatus.OUTCOME_UNKNOWN
    assert Run.objects.get(pk=run.pk).status == RunStatus.NEEDS_ATTENTION
    return step


def test_it_shows_status_budget_steps_and_events(as_ravi, acme):
    approval = park_on_approval(acme.asha, "refunder")
    decide_approval(approval_id=approval.pk, user=acme.ravi, approve=True, reason="verified")
    run = drive(approval.run_id)

    response = as_ravi.get(run_url(run.pk))

    html = response.content.decode()
    assert response.status_code == 200
    assert 'id="run-status" data-status="succeeded">succeeded</td>' in html
    budget = response.context["budget"]
    assert (
        budget["limit"] == "USD 2.00" and budget["reserved"] == "USD 0.00" and budget["spent"] != "USD 0.00"
    )
    steps = response.context["steps"]
    assert [(r["step"].seq, r["step"].kind, r["step"].status) for r in steps] == [
        (1, "model", "succeeded"),
        (2, "tool", "succeeded"),
        (3, "model", "succeeded"),
    ]
    assert "platform__echo approved by ravi: verified" in html
    assert "Cancel run" not in html


def test_the_run_page_is_a_timeline_of_model_turns_with_their_tool_calls_and_events(as_ravi, acme):
    approval = park_on_approval(acme.asha, "refunder")
    decide_approval(approval_id=approval.pk, user=acme.ravi, approve=True, reason="verified")
    run = drive(approval.run_id)
    Tenant.objects.filter(pk=acme.tenant.pk).update(time_zone="Asia/Kolkata")

    response = as_ravi.get(run_url(run.pk))

    steps = response.context["steps"]
    assert [(r["step"].seq, r["step"].kind, r["summary"]) for r in steps] == [
        (1, "model", "Let me do that. → calls platform__echo"),
        (2, "tool", ""),
        (3, "model", "done"),
    ]
    call = steps[1]
    assert "12499" in call["result"] and "TXN-1001" in call["result"]  # echo answers its arguments
    assert '"amount": 12499' in call["result"]  # pretty-printed JSON, one key a line
    assert "approval_approved" in {e["event"].kind for e in call["events"]}
    assert steps[0]["usage"]["input"] > 0 and steps[0]["cost"].startswith("USD ")
    assert response.context["counts"] == {"steps": 3, "model": 2, "tool": 1}
    html = response.content.decode()
    assert " micros" not in html  # every amount in one unit, with its currency
    assert "times in Asia/Kolkata" in html


def test_a_running_run_page_polls_a_change_marker(as_ravi, acme):
    approval = park_on_approval(acme.asha, "refunder")
    page = as_ravi.get(run_url(approval.run_id))
    watch = as_ravi.get(run_url(approval.run_id, "watch/")).json()
    assert page.context["marker"] == watch["marker"] and watch["status"] == "waiting_approval"

    decide_approval(approval_id=approval.pk, user=acme.ravi, approve=False, reason="no")

    assert as_ravi.get(run_url(approval.run_id, "watch/")).json()["marker"] != watch["marker"]


def test_it_lists_runs_filtered_by_status_and_agent(as_ravi, acme):
    refund = park_on_approval(acme.asha, "refunder")
    noop = park_on_approval(acme.asha, "nooper")
    Run.objects.filter(pk=noop.run_id).update(status=RunStatus.FAILED)

    def listed(query):
        return {run.pk for run in as_ravi.get(RUNS + query).context["cl"].result_list}

    assert listed("") == {refund.run_id, noop.run_id}
    assert listed("?status__exact=waiting_approval") == {refund.run_id}
    assert listed(f"?agent__id__exact={refund.run.agent_id}") == {refund.run_id}


def test_it_cancels_a_run_waiting_for_approval(as_ravi, acme):
    approval = park_on_approval(acme.asha, "refunder")

    response = as_ravi.post(run_url(approval.run_id, "cancel/"), {"reason": "customer withdrew"}, follow=True)

    assert any("cancel requested" in m for m in messages_of(response))
    assert Run.objects.get(pk=approval.run_id).status == RunStatus.CANCELLED
    approval.refresh_from_db()
    assert approval.status == ApprovalStatus.VOIDED


def test_another_tenants_run_cannot_be_cancelled(as_ravi, globex):
    assert as_ravi.post(run_url(globex.approval.run_id, "cancel/")).status_code == 404
    assert Run.objects.get(pk=globex.approval.run_id).status == RunStatus.WAITING_APPROVAL


def test_it_resolves_an_unknown_outcome_as_succeeded_and_the_run_finishes(as_ravi, unknown_step):
    page = as_ravi.get(run_url(unknown_step.run_id))
    assert "Resolve step 2" in page.content.decode()

    response = as_ravi.post(
        run_url(unknown_step.run_id, "steps/2/resolve/"),
        {
            "s2-outcome": "succeeded",
            "s2-result": "echoed, provider ref E-7",
            "s2-reason": "checked the provider log",
        },
        follow=True,
    )

    assert "step 2 resolved as succeeded" in messages_of(response)
    unknown_step.refresh_from_db()
    assert unknown_step.status == StepStatus.RESOLVED_SUCCEEDED
    assert unknown_step.observation == "echoed, provider ref E-7"
    assert drive(unknown_step.run_id).status == RunStatus.SUCCEEDED
    # The admin's Recent actions: who said what happened to a call of unknown outcome.
    entry = LogEntry.objects.get(object_id=str(unknown_step.run_id))
    assert entry.user.username == "ravi"
    assert entry.get_change_message() == "Resolved step 2 as succeeded: checked the provider log"
    recent = as_ravi.get("/admin/").content.decode()  # the index's Recent actions
    assert escape(entry.object_repr) in recent and entry.object_repr == str(
        Run.objects.get(pk=unknown_step.run_id)
    )


def test_it_retries_an_unsafe_call_only_with_the_override(as_ravi, unknown_step):
    url = run_url(unknown_step.run_id, "steps/2/resolve/")
    retry = {"s2-outcome": "retry", "s2-reason": "provider says it never arrived"}

    refused = as_ravi.post(url, retry, follow=True)

    assert any("is unsafe: retrying may repeat its effect" in m for m in messages_of(refused))
    unknown_step.refresh_from_db()
    assert unknown_step.status == StepStatus.OUTCOME_UNKNOWN

    as_ravi.post(url, {**retry, "s2-override": "on"})

    unknown_step.refresh_from_db()
    assert unknown_step.status == StepStatus.RETRIED


def test_a_user_without_approve_tool_may_not_resolve(client, acme, unknown_step):
    nina = make_supervisor(acme.tenant, "nina")
    client.force_login(nina)

    assert "Resolve step" not in client.get(run_url(unknown_step.run_id)).content.decode()
    response = client.post(
        run_url(unknown_step.run_id, "steps/2/resolve/"),
        {"s2-outcome": "failed", "s2-reason": "guess"},
        follow=True,
    )

    assert any("resolving needs approve_tool" in m for m in messages_of(response))
    unknown_step.refresh_from_db()
    assert unknown_step.status == StepStatus.OUTCOME_UNKNOWN


def test_it_shows_the_share_of_input_read_from_the_prompt_cache(as_ravi, acme):
    approval = park_on_approval(acme.asha, "refunder")
    decide_approval(approval_id=approval.pk, user=acme.ravi, approve=True, reason="verified")
    run = drive(approval.run_id)
    # What a provider reported for the two model calls (the scripted model reports no cache use).
    first, second = Step.objects.filter(run=run, kind="model").order_by("seq")
    Step.objects.filter(pk=first.pk).update(
        usage={"input_tokens": 100, "cached_input_tokens": 0, "cache_write_tokens": 900, "output_tokens": 5}
    )
    Step.objects.filter(pk=second.pk).update(
        usage={"input_tokens": 20, "cached_input_tokens": 900, "cache_write_tokens": 80, "output_tokens": 5}
    )

    html = as_ravi.get(run_url(run.pk)).content.decode()

    assert (
        '<tr id="run-cache"><td>2000</td><td>900</td><td>980</td>\n        <td>120</td><td>45.0%</td></tr>'
        in html
    )


def test_it_shows_a_run_waiting_to_be_admitted(as_ravi, acme):
    from budgets import services as budgets

    tenant = acme.asha.tenant
    spent = budgets.reserve(tenant=tenant, amount_micros=tenant.daily_budget_micros, purpose="model")
    budgets.settle(spent.pk, actual_micros=spent.amount_micros)
    run, _ = start_run(user=acme.asha, agent="refunder", input={"case": "later"})

    html = as_ravi.get(run_url(run.pk)).content.decode()

    assert 'id="run-status" data-status="waiting_budget">waiting for budget</td>' in html
    admission = html.split('<p id="run-admission" data-expected-start="next_local_midnight">')[1].split(
        "</p>"
    )[0]
    assert admission.startswith(
        "Today's budget is spent: expected to start after the next local midnight, at 00:00 "
    ), admission
    assert ", in " in admission and "0 waiting runs ahead" in admission


def test_the_run_page_lists_the_runs_files_and_downloads_them_for_who_may_read_the_run(as_ravi, acme):
    from artifacts import services as artifacts

    run, _ = start_run(user=acme.asha, agent="refunder", input={"case": "files"})
    stored = artifacts.store(
        run=run, name="ledger.csv", media_type="text/csv", content=b"id\n1\n", source="upload"
    )
    html = as_ravi.get(run_url(run.pk)).content.decode()
    link = run_url(run.pk, f"artifacts/{stored.pk}/")
    assert "ledger.csv" in html and link in html
    download = as_ravi.get(link)
    assert download.status_code == 200 and download.content == b"id\n1\n"
    other, _ = start_run(user=acme.asha, agent="refunder", input={"case": "other"})
    assert as_ravi.get(run_url(other.pk, f"artifacts/{stored.pk}/")).status_code == 404


def test_the_timeline_shows_a_folds_summary_with_its_usage(as_ravi, acme):
    """A summary step (runs/engine/summaries.py) is a row of the timeline: what it wrote, its tokens."""
    approval = park_on_approval(acme.asha, "refunder")
    decide_approval(approval_id=approval.pk, user=acme.ravi, approve=True, reason="verified")
    run = drive(approval.run_id)
    Step.objects.create(
        run=run,
        seq=4,
        kind="summary",
        status=StepStatus.SUCCEEDED,
        result={"text": "The refund  TXN-1001\nwas approved by ravi.", "at": 3},
        usage={"input_tokens": 900, "cached_input_tokens": 0, "cache_write_tokens": 0, "output_tokens": 40},
        cost_micros=120,
    )

    steps = as_ravi.get(run_url(run.pk)).context["steps"]

    row = steps[-1]
    assert (row["step"].kind, row["summary"]) == (
        "summary",
        "summary of a fold: The refund TXN-1001 was approved by ravi.",
    )
    assert (row["usage"]["input"], row["usage"]["output"]) == (900, 40)
