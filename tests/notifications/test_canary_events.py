"""A canary that ends, by the watcher or by hand, is notified: a signed webhook per rollback and
per promotion, counted at a local receiver."""

from __future__ import annotations

import json

import pytest
from rest_framework.test import APIClient

from agents import services as agents
from evals import canary
from notifications.models import Delivery, DeliveryStatus, Event
from notifications.services import scan, send_due
from runs.services import start_run
from tests import factories
from tests.conftest import drive
from tests.notifications.conftest import make_webhook

pytestmark = pytest.mark.django_db(transaction=True)

ENDS = [Event.CANARY_ROLLED_BACK, Event.CANARY_PROMOTED]


def notify() -> dict:
    return {**scan(), **send_due(budget_seconds=10)}


@pytest.fixture
def helper(tenant, asha, builtins):
    """`helper` v1 answers at once; v2 asks for a tool with one step allowed, so its runs stop."""
    factories.grant(builtins["echo"], use=[asha])
    stable = factories.make_endpoint(tenant, name="stable", config={"turns": [{"text": "done"}]})
    failing = factories.make_endpoint(
        tenant,
        name="canary",
        config={"turns": [{"tool_calls": [{"name": builtins["echo"].name, "arguments": {"text": "hi"}}]}]},
    )
    v1 = factories.make_agent(tenant, name="helper", endpoint=stable, tools=[builtins["echo"]])
    v2 = factories.make_agent(
        tenant,
        name="helper",
        endpoint=failing,
        tools=[builtins["echo"]],
        alias="candidate",
        limits={"max_steps": 1},
    )
    return v1, v2


def test_an_automatic_rollback_delivers_one_signed_webhook(tenant, asha, ravi, helper, receiver):
    v1, v2 = helper
    make_webhook(tenant, receiver.url, ENDS)
    scan()  # the cursors start here
    agents.start_canary(
        tenant=tenant, agent="helper", alias="prod", version=v2.number, percent=100, rules={"min_runs": 3}
    )
    for i in range(3):
        assert drive(start_run(user=asha, agent="helper", input={"i": i})[0].pk).status == "stopped"
    assert canary.watch()

    assert notify() == {"created": 1, "delivered": 1, "retrying": 0, "failed": 0}
    notify()  # read again within the look-back: made once

    assert len(receiver.requests) == 1
    request = receiver.requests[0]
    assert request.verified and request.headers["X-Event"] == "canary_rolled_back"
    body = json.loads(request.body)
    assert body["tenant"] == tenant.slug and (body["agent"], body["alias"]) == ("helper", "prod")
    assert (body["version"], body["canary_version"]) == (v1.number, v2.number)
    assert body["automatic"] is True and body["actor"] is None
    assert "failure rate 100% on the canary" in body["reason"]
    assert body["arms"]["canary"]["runs"] == 3 and body["arms"]["canary"]["failed"] == 3
    delivery = Delivery.objects.get()
    assert delivery.status == DeliveryStatus.DELIVERED and delivery.run_id is None


def test_a_rollback_and_a_promotion_by_hand_are_notified_to_webhooks_that_want_them(
    tenant, ravi, helper, receiver
):
    v1, v2 = helper
    make_webhook(tenant, receiver.url, ENDS)
    make_webhook(tenant, receiver.url, [Event.RUN_NEEDS_ATTENTION], name="attention-only")
    other = factories.make_tenant("elsewhere")
    make_webhook(other, receiver.url, ENDS, name="other-tenant")
    scan()
    staff = APIClient()
    staff.force_authenticate(ravi)
    url = "/v1/agents/helper/aliases/prod/canary"

    assert staff.put(url, {"version": v2.number, "percent": 10}, format="json").status_code == 200
    assert staff.post(f"{url}/rollback", {"reason": "latency"}, format="json").status_code == 200
    assert staff.put(url, {"version": v2.number, "percent": 10}, format="json").status_code == 200
    assert staff.post(f"{url}/promote", {"reason": "a quiet week"}, format="json").status_code == 200
    notify()

    assert all(r.verified for r in receiver.requests)
    bodies = sorted((json.loads(r.body) for r in receiver.requests), key=lambda b: b["id"])
    assert [(b["event"], b["actor"], b["automatic"], b["reason"]) for b in bodies] == [
        ("canary_rolled_back", "ravi", False, "latency"),
        ("canary_promoted", "ravi", False, "a quiet week"),
    ]
    assert (bodies[0]["version"], bodies[0]["canary_version"]) == (v1.number, v2.number)
    assert (bodies[1]["version"], bodies[1]["canary_version"]) == (v2.number, v2.number)
    assert {b["tenant"] for b in bodies} == {tenant.slug}
