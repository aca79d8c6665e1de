"""The decision block in a real browser at 1366x768 (issue 39): every fact a supervisor needs sits
above the Approve button and inside the first screen, measured; then a refund above INR 10,000
is approved by two supervisors end to end with a real worker, the first approval alone sending
nothing, a stale tab answered with what happened, and each decision in the admin's Recent actions.
"""

from __future__ import annotations

import httpx
import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.contenttypes.models import ContentType

from approvals.models import Approval, ApprovalStatus
from runs.models import Run, RunStatus
from runs.services import start_run
from tests import factories
from tests.admin.helpers import make_supervisor
from tests.admin.test_inbox_browser import in_browser
from tests.approvals.test_cedar_actions import install_rules
from tests.conftest import drive
from tests.servers import BankServer, Worker, wait_for
from tools.models import Tool

pytestmark = pytest.mark.django_db(transaction=True)

WIDTH, HEIGHT = 1366, 768

RULES = """
@id("refunds-allowed")
permit (principal, action, resource);

@id("refund-needs-supervisor")
@approval("refunds above INR 5,000 wait for a supervisor")
permit (principal, action == Action::"bank__issue_refund", resource)
when { context.arguments.amount > 5000 };

@id("large-refund-needs-two")
@approval("refunds above INR 10,000 need two supervisors")
@approvers("2")
permit (principal, action == Action::"bank__issue_refund", resource)
when { context.arguments.amount > 10000 };
"""

REQUEST = "Priya Shah says she was charged twice for her BookMyShow tickets and wants her money back."


@pytest.fixture(scope="module")
def shared_bank():
    server = BankServer().start()
    yield server
    server.stop()


@pytest.fixture
def bank_tenant(transactional_db, shared_bank):
    httpx.post(f"{shared_bank.url}/ledger/reset", timeout=10).raise_for_status()
    tenant = factories.make_tenant("bank", currency="INR", exchange_rate=83)
    tools = factories.make_bank_tools(tenant, shared_bank.mcp_url)
    # Only the tenant's Cedar policies ask for approval here: the tool's own rule stays `never`.
    Tool.objects.filter(pk=tools["issue_refund"].pk).update(approval_policy="never")
    asha = factories.make_user(tenant, "asha")
    ravi = make_supervisor(tenant, "ravi")
    meera = make_supervisor(tenant, "meera")
    factories.grant(tools["lookup_transaction"], use=[asha])
    factories.grant(tools["issue_refund"], use=[asha], approve=[ravi, meera])
    assert install_rules(tenant, RULES) == []
    return tenant, tools, asha


def refund_agent(tenant, tools, *, amount: int, name: str, transaction: str = "TXN-1003"):
    """Looks the transaction up, then proposes a refund of `amount` on it."""
    lookup, refund = tools["lookup_transaction"], tools["issue_refund"]
    endpoint = factories.make_endpoint(
        tenant,
        name=f"{name}-model",
        config={
            "turns": [
                {"tool_calls": [{"name": lookup.name, "arguments": {"transaction_id": transaction}}]},
                {
                    "text": "The charge is a duplicate; refunding it.",
                    "tool_calls": [
                        {
                            "name": refund.name,
                            "arguments": {"transaction_id": transaction, "amount": amount, "currency": "INR"},
                        }
                    ],
                },
                {"text": "Refunded."},
            ]
        },
    )
    factories.make_agent(tenant, name=name, tools=[lookup, refund], endpoint=endpoint)


def park(asha, agent: str) -> Approval:
    run, _ = start_run(
        user=asha,
        agent=agent,
        input={"request": REQUEST, "customer_name": "Priya Shah", "account": "ACC-2231"},
    )
    run = drive(run.pk)
    assert run.status == RunStatus.WAITING_APPROVAL, (run.status, run.error)
    return Approval.objects.get(run=run)


def log_in(page, base: str, username: str, next_url: str) -> None:
    page.goto(f"{base}/admin/login/?next={next_url}")
    page.fill("#id_username", username)
    page.fill("#id_password", "pw")
    page.click("input[type=submit]")


FACTS = [
    "#summary",
    "#decision-amount",
    "#decision-parties",
    "#decision-asked",
    "#decision-request",
    "#decision-why",
    "#decision-facts",
    "#decision-approvals",
]


def test_every_fact_sits_above_the_buttons_on_the_first_screen(live_server, bank_tenant):
    tenant, tools, asha = bank_tenant
    refund_agent(tenant, tools, amount=9999, name="refunder")
    approval = park(asha, "refunder")
    url = f"/admin/approvals/approval/{approval.pk}/change/"
    seen: dict = {}

    def look(page):
        page.set_viewport_size({"width": WIDTH, "height": HEIGHT})
        log_in(page, live_server.url, "ravi", url)
        page.wait_for_selector("#decision-form")
        assert page.evaluate("window.scrollY") == 0
        button = page.locator("#decision-form input.approve").bounding_box()
        seen["button"] = button
        seen["boxes"] = {}
        for selector in FACTS[:-1]:
            box = page.locator(selector).bounding_box()
            seen["boxes"][selector] = box
        seen["texts"] = {s: page.locator(s).inner_text() for s in FACTS[:-1]}
        seen["flag"] = page.locator("#decision-facts .fact-flag").bounding_box()
        seen["page"] = page.locator("#content-main").inner_text()
        # A denial without a reason is refused with a field error; nothing is decided.
        page.click("#decision-form input.deny")
        seen["deny_error"] = page.locator("#decision-form .errorlist").inner_text()

    in_browser(look, timeout=600)
    button = seen["button"]
    assert button["y"] + button["height"] <= HEIGHT, f"the Approve button is below the fold: {button}"
    for selector, box in seen["boxes"].items():
        assert box is not None, f"{selector} is not on the page"
        assert box["y"] + box["height"] <= button["y"], (
            f"{selector} is not above the buttons: {box} vs {button}"
        )
    assert seen["flag"]["y"] + seen["flag"]["height"] <= button["y"]

    texts = seen["texts"]
    assert "INR 9,999.00" in texts["#decision-amount"]
    assert "Priya Shah" in texts["#decision-parties"] and "TXN-1003" in texts["#decision-parties"]
    assert "ACC-2231" in texts["#decision-parties"]
    assert texts["#decision-asked"].startswith("asha at ")
    assert "charged twice for her BookMyShow tickets" in texts["#decision-request"]
    assert "refund-needs-supervisor" in texts["#decision-why"]
    assert "context.arguments.amount > 5000" in texts["#decision-why"]  # the policy's text
    assert "INR 899.00" in texts["#decision-facts"] and "pending" in texts["#decision-facts"]
    assert (
        "the amount INR 9,999.00 is more than the INR 899.00 that TXN-1003 shows" in texts["#decision-facts"]
    )
    assert "Policy\nnever" not in seen["page"] and "\tnever" not in seen["page"]
    assert "a reason is required to deny" in seen["deny_error"]
    approval.refresh_from_db()
    assert approval.status == ApprovalStatus.PENDING


@pytest.fixture
def worker(transactional_db):
    """A real Celery worker, given longer than the shared fixture's 60 s to get ready: it starts
    while Chromium and the live server load the machine."""
    process = Worker("w1")
    try:
        yield process.start(timeout=300)
    finally:
        process.stop()


def test_two_supervisors_approve_a_large_refund_end_to_end(live_server, bank_tenant, shared_bank, worker):
    tenant, tools, asha = bank_tenant
    # The example bank refunds at most the transaction's amount (TXN-1001: INR 12,499).
    refund_agent(tenant, tools, amount=12000, name="big-refunder", transaction="TXN-1001")
    approval = park(asha, "big-refunder")
    assert approval.required_approvals == 2
    url = f"/admin/approvals/approval/{approval.pk}/change/"
    seen: dict = {}

    def refunds() -> int:
        return len(shared_bank.effects("issue_refund"))

    def first(page):
        page.set_viewport_size({"width": WIDTH, "height": HEIGHT})
        log_in(page, live_server.url, "ravi", url)
        page.fill("#decision-form textarea", "matches the ledger")
        page.click("#decision-form input.approve")
        seen["ravi_message"] = page.locator("ul.messagelist").inner_text()
        page.goto(f"{live_server.url}{url}")
        seen["counted"] = page.locator("#decision-approvals").inner_text()
        box = page.locator("#decision-approvals").bounding_box()
        seen["counted_above"] = box["y"] + box["height"] <= page.locator("input.approve").bounding_box()["y"]

    in_browser(first, timeout=600)
    assert "your approval counted, 1 of 2 approvals" in seen["ravi_message"]
    assert seen["counted"].startswith("1 of 2 approvals: ravi at ") and seen["counted_above"]
    # The first approval alone never dispatches: the worker has nothing to do with the run.
    approval.refresh_from_db()
    assert approval.status == ApprovalStatus.PENDING
    assert Run.objects.get(pk=approval.run_id).status == RunStatus.WAITING_APPROVAL
    assert refunds() == 0

    def second(page):
        browser = page.context.browser
        # ravi keeps a tab open on the approval, from before meera decides.
        ravi = browser.new_context(viewport={"width": WIDTH, "height": HEIGHT})
        ravi_page = ravi.new_page()
        log_in(ravi_page, live_server.url, "ravi", url)
        stale = ravi.new_page()
        stale.goto(f"{live_server.url}{url}")
        # meera, in a browser session of her own, gives the second approval.
        other = browser.new_context(viewport={"width": WIDTH, "height": HEIGHT})
        meera = other.new_page()
        log_in(meera, live_server.url, "meera", url)
        meera.fill("#decision-form textarea", "second pair of eyes")
        meera.click("#decision-form input.approve")
        seen["meera_message"] = meera.locator("ul.messagelist").inner_text()
        other.close()
        stale.click("#decision-form input.approve")
        seen["stale_message"] = stale.locator("ul.messagelist li").first.inner_text()
        seen["stale_class"] = stale.locator("ul.messagelist li").first.get_attribute("class")
        ravi.close()

    in_browser(second, timeout=600)
    assert "approved: bank__issue_refund" in seen["meera_message"].lower()
    assert "already approved by meera at " in seen["stale_message"], seen["stale_message"]
    assert "success" not in (seen["stale_class"] or "")

    run = wait_for(
        lambda: (r := Run.objects.get(pk=approval.run_id)).status == RunStatus.SUCCEEDED and r,
        timeout=120,
        what="the run to succeed on the worker",
    )
    assert run.status == RunStatus.SUCCEEDED
    assert refunds() == 1  # dispatched once, by the second approval
    approval.refresh_from_db()
    assert approval.status == ApprovalStatus.CONSUMED and approval.decided_by.username == "meera"

    # Recent actions: one row per decision that changed something, none for the stale repeat.
    entries = LogEntry.objects.filter(
        content_type=ContentType.objects.get_for_model(Approval), object_id=str(approval.pk)
    ).order_by("action_time")
    assert [(e.user.username, e.get_change_message()) for e in entries] == [
        ("ravi", "Approved (1 of 2 approvals): matches the ledger"),
        ("meera", "Approved: second pair of eyes"),
    ]
