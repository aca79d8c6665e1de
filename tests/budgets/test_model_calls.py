"""Money around real model calls: prices with cache tokens, overages, holds for lost answers.

The model endpoints are the fake OpenAI and Anthropic servers (tests/fakes/model_servers.py),
which report usage like the real APIs and can hang, time out or refuse on request.
"""

from __future__ import annotations

import math
from decimal import Decimal

import pytest
from django.db import connection
from rest_framework.test import APIClient

from budgets import services as budgets
from budgets.models import BudgetAccount, LedgerEntry, Reservation
from runs.models import Run, Step
from runs.recovery import sweeper
from runs.services import start_run
from tests import factories
from tests.budgets.conftest import anthropic_endpoint, assert_books_balance, openai_endpoint
from tests.conftest import drive
from tests.servers import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]


def api(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


def day_account(tenant) -> BudgetAccount:
    return budgets.tenant_day_account(tenant, budgets.local_day(tenant))


def price(usage: dict, endpoint) -> int:
    """What the reported usage costs at the endpoint's prices (per million tokens, in micros)."""
    return math.ceil(
        Decimal(usage.get("input_tokens", 0)) * endpoint.price_input
        + Decimal(usage.get("cache_read_input_tokens", 0)) * endpoint.price_cached_input
        + Decimal(usage.get("cache_creation_input_tokens", 0)) * endpoint.price_cache_write
        + Decimal(usage.get("output_tokens", 0)) * endpoint.price_output
    )


def model_reservations(run) -> list[Reservation]:
    return list(Reservation.objects.filter(run=run, purpose="model").order_by("created_at"))


def test_it_prices_cache_reads_and_writes_at_their_own_prices(tenant, asha, builtins, fake_anthropic):
    fake_anthropic.tool_turns = 1
    endpoint = anthropic_endpoint(tenant, fake_anthropic)
    factories.grant(builtins["echo"], use=[asha])
    factories.make_agent(tenant, endpoint=endpoint, tools=[builtins["echo"]])
    run, _ = start_run(user=asha, agent="agent", input={"case": "TXN-1001"})
    run = drive(run.pk)
    assert run.status == "succeeded", run.error

    first, second = (reply["usage"] for reply in fake_anthropic.replies)
    assert first["cache_creation_input_tokens"] > 0 and first["cache_read_input_tokens"] == 0
    # The second call reads all of the first back and writes only its new turn (the moving breakpoint).
    assert second["cache_read_input_tokens"] == first["cache_creation_input_tokens"] > 0
    assert 0 < second["cache_creation_input_tokens"] < first["cache_creation_input_tokens"]
    steps = list(Step.objects.filter(run=run, kind="model").order_by("seq"))
    assert [s.cost_micros for s in steps] == [price(first, endpoint), price(second, endpoint)]
    assert steps[1].usage == {
        "input_tokens": second["input_tokens"],
        "output_tokens": second["output_tokens"],
        "cached_input_tokens": second["cache_read_input_tokens"],
        "cache_write_tokens": second["cache_creation_input_tokens"],
    }
    # The cache read is cheaper than the same tokens uncached (0.3 vs 3 per million).
    uncached = {
        **second,
        "input_tokens": second["input_tokens"]
        + second["cache_read_input_tokens"]
        + second["cache_creation_input_tokens"],
        "cache_read_input_tokens": 0,
        "cache_creation_input_tokens": 0,
    }
    assert price(second, endpoint) < price(uncached, endpoint)

    reservations = model_reservations(run)
    assert [r.actual_micros for r in reservations] == [s.cost_micros for s in steps]
    assert all(r.status == "settled" and r.actual_micros <= r.amount_micros for r in reservations)
    total = sum(s.cost_micros for s in steps)
    assert run.budget.spent_micros == day_account(tenant).spent_micros == total
    assert_books_balance(tenant)


def test_it_records_and_flags_an_answer_that_cost_more_than_reserved(tenant, asha, fake_openai):
    """A compatible server that ignores the output limit: the overage is charged, flagged, kept.

    Unstreamed: a streamed answer is cut at the limit by the platform (tests/e2e/test_bounded_calls_e2e.py)."""
    endpoint = openai_endpoint(tenant, fake_openai)
    endpoint.stream = False
    endpoint.save()
    factories.make_agent(tenant, endpoint=endpoint, limits={"max_output_tokens": 16})
    fake_openai.queue({"text": "a long answer " * 300})
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)
    assert run.status == "succeeded", run.error
    assert fake_openai.requests[0]["max_completion_tokens"] == 16

    (reservation,) = model_reservations(run)
    actual = reservation.actual_micros
    assert reservation.overage and actual > reservation.amount_micros
    overage = actual - reservation.amount_micros
    for account in (run.budget, day_account(tenant)):
        assert (account.spent_micros, account.overage_micros, account.reserved_micros) == (actual, overage, 0)
    assert LedgerEntry.objects.get(reservation=reservation, kind="overage").amount_micros == overage
    # The settle's figures are on the step's own outcome event: no budget line of its own.
    (outcome,) = [e for e in run.events.filter(kind="step") if "budget" in e.data]
    assert outcome.data["budget"]["settled"] == actual
    assert f"settled {actual}" in outcome.message
    assert not run.events.filter(kind="budget").exists()
    assert_books_balance(tenant)


def test_a_timeout_after_sending_is_held_and_the_call_is_made_again(tenant, asha, fake_openai):
    # No backoff after the timeout (tests/llm covers it): this test is about the held charge, and
    # drive() runs the engine in-process with no broker to deliver the backoff's countdown.
    endpoint = openai_endpoint(tenant, fake_openai, timeout_seconds=0.5, timeout_backoff_seconds=0)
    factories.make_agent(tenant, endpoint=endpoint)
    fake_openai.queue({"fault": "timeout", "seconds": 3})  # received, answered too late: charged
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)
    assert run.status == "succeeded", run.error
    assert len(fake_openai.requests) == 2

    lost, retried = model_reservations(run)
    assert (lost.status, retried.status) == ("held", "settled")
    assert Step.objects.get(pk=lost.step_id).status == "outcome_unknown"
    for account in (BudgetAccount.objects.get(run=run), day_account(tenant)):
        assert account.held_micros == lost.amount_micros
        assert account.spent_micros == retried.actual_micros
    assert_books_balance(tenant)


@pytest.mark.parametrize("fault", ["429", "500"])
def test_a_refusal_by_the_provider_is_released_not_held(tenant, asha, fake_openai, fault):
    endpoint = openai_endpoint(tenant, fake_openai)
    factories.make_agent(tenant, endpoint=endpoint)
    fake_openai.queue({"fault": fault, "retry_after": 0})
    run, _ = start_run(user=asha, agent="agent", input={})
    run = drive(run.pk)
    assert run.status == "succeeded", run.error

    refused, answered = model_reservations(run)
    assert (refused.status, refused.actual_micros, answered.status) == ("released", 0, "settled")
    for account in (run.budget, day_account(tenant)):
        assert (account.held_micros, account.spent_micros) == (0, answered.actual_micros)
    assert_books_balance(tenant)


def test_a_model_call_lost_with_its_worker_is_held_until_a_person_reconciles_it(
    tenant, asha, ravi, fake_openai, workers
):
    endpoint = openai_endpoint(tenant, fake_openai, timeout_seconds=60)
    factories.make_agent(tenant, endpoint=endpoint)
    fake_openai.queue({"fault": "timeout", "seconds": 30})  # the call hangs while the worker dies
    w1 = workers("w1")
    run, _ = start_run(user=asha, agent="agent", input={})
    wait_for(lambda: fake_openai.requests, timeout=30, what="the model call to arrive")
    w1.kill()
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE runs_run SET lease_expires_at = now() - interval '1 second' WHERE id = %s", [run.pk]
        )
    workers("w2")

    def swept_and_ended():  # play Celery beat: a lost message is re-sent too
        sweeper.sweep()
        return (r := Run.objects.get(pk=run.pk)).is_terminal and r

    run = wait_for(swept_and_ended, timeout=90, interval=0.5, what="run end")
    assert run.status == "succeeded", run.error

    lost, retried = model_reservations(run)
    assert (lost.status, retried.status) == ("held", "settled")
    step = Step.objects.get(pk=lost.step_id)
    assert (step.status, step.crashes) == ("outcome_unknown", 1)
    assert run.events.filter(kind="recovery", skeleton__action="hold_and_retry").exists()
    accounts = [BudgetAccount.objects.get(run=run), day_account(tenant)]
    assert [a.held_micros for a in accounts] == [lost.amount_micros] * 2
    assert_books_balance(tenant)

    # Only tenant staff clear holds, once, with a reason.
    path = f"/v1/reservations/{lost.pk}"
    assert (
        api(asha).post(f"{path}/reconcile", {"actual_micros": 1, "note": "x"}, format="json").status_code
        == 403
    )
    assert api(ravi).post(f"{path}/reconcile", {"actual_micros": 1}, format="json").status_code == 400
    actual = lost.amount_micros // 3
    answer = api(ravi).post(
        f"{path}/reconcile", {"actual_micros": actual, "note": "usage export row 17"}, format="json"
    )
    assert answer.status_code == 200, answer.content
    assert (answer.json()["status"], answer.json()["actual_micros"]) == ("reconciled", actual)
    again = api(ravi).post(f"{path}/write-off", {"note": "twice"}, format="json")
    assert again.status_code == 409 and again.json()["error"]["code"] == "not_held"
    for account in (BudgetAccount.objects.get(run=run), day_account(tenant)):
        assert (account.held_micros, account.spent_micros) == (0, retried.actual_micros + actual)
    assert_books_balance(tenant)


def test_staff_write_off_a_hold_and_cannot_touch_other_tenants(tenant, asha, ravi):
    factories.make_agent(tenant, turns=[{"text": "done"}])
    run, _ = start_run(user=asha, agent="agent", input={})
    held = budgets.reserve(tenant=tenant, run=run, amount_micros=9_000, purpose="model")
    budgets.hold(held.pk, note="lost")
    settled = budgets.reserve(tenant=tenant, run=run, amount_micros=1_000, purpose="model")
    budgets.settle(settled.pk, actual_micros=1_000)

    other_tenant = factories.make_tenant("globex")
    outsider = factories.make_user(other_tenant, "otto", staff=True)
    assert (
        api(outsider)
        .post(f"/v1/reservations/{held.pk}/write-off", {"note": "mine"}, format="json")
        .status_code
        == 404
    )
    refused = api(ravi).post(f"/v1/reservations/{settled.pk}/write-off", {"note": "oops"}, format="json")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "not_held"
    listed = api(ravi).get("/v1/reservations?status=held").json()["results"]
    assert [r["id"] for r in listed] == [str(held.pk)]

    done = api(ravi).post(
        f"/v1/reservations/{held.pk}/write-off", {"note": "provider shows no charge"}, format="json"
    )
    assert done.status_code == 200 and done.json()["status"] == "written_off"
    held.refresh_from_db()
    assert (held.closed_by, held.note) == (ravi, "")
    assert LedgerEntry.objects.get(reservation=held, kind="write_off").note == "provider shows no charge"
    run.budget.refresh_from_db()
    assert (run.budget.held_micros, run.budget.spent_micros) == (0, 1_000)
    assert_books_balance(tenant)


def test_a_success_answer_that_cannot_be_read_is_held_not_released(tenant, asha):
    """A 2xx was billed by the provider even if its body is garbage (a proxy error page)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Garbage(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", "21")
            self.end_headers()
            self.wfile.write(b"<html>upstream ok</html>"[:21])

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Garbage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = factories.make_endpoint(
            tenant, name="proxy", kind="openai", base_url=f"http://127.0.0.1:{server.server_address[1]}/v1"
        )
        factories.make_agent(tenant, endpoint=endpoint)
        run = drive(start_run(user=asha, agent="agent", input={})[0].pk)
    finally:
        server.shutdown()
        server.server_close()
    assert run.status == "failed"
    reservations = model_reservations(run)
    assert len(reservations) == 5 and {r.status for r in reservations} == {"held"}
    run.budget.refresh_from_db()
    assert run.budget.held_micros == sum(r.amount_micros for r in reservations)
    assert_books_balance(tenant)
