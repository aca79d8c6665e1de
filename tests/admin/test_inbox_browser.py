"""A supervisor's day in a real browser: log in, open the inbox, approve, watch the run succeed.

The live server and a real Celery worker share the test database, so the run continues on the
worker after the approval, exactly as in production.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from approvals.models import ApprovalStatus
from core.ids import short
from tests.admin.helpers import park_on_approval

pytestmark = pytest.mark.django_db(transaction=True)

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


def in_browser(script, *, timeout: float = 180):
    """Run `script(page)` in Chromium on a thread of its own.

    Sync Playwright keeps an asyncio loop running in its thread, and Django refuses ORM calls
    from a thread with a running loop; the test's own thread stays free for the ORM.
    """
    from playwright.sync_api import sync_playwright

    if not os.path.exists(CHROMIUM):
        pytest.fail(
            f"{CHROMIUM} is missing: `apt-get install -y chromium` (scripts/ensure_services.sh does it)"
        )
    outcome: dict = {}

    def target():
        try:
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(
                    executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True
                )
                try:
                    page = browser.new_page()
                    page.set_default_timeout(20_000)
                    script(page)
                finally:
                    browser.close()
        except BaseException as exc:  # handed to the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="browser")
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"the browser script did not finish within {timeout}s"
    if "error" in outcome:
        raise outcome["error"]


def test_a_supervisor_approves_from_the_inbox_and_the_run_succeeds(live_server, acme, workers):
    approval = park_on_approval(acme.asha, "refunder")
    run_id, tool = str(approval.run_id), approval.tool.name
    workers("w1")

    def supervise(page):
        page.goto(f"{live_server.url}/admin/login/?next=/admin/approvals/approval/")
        page.fill("#id_username", "ravi")
        page.fill("#id_password", "pw")
        page.click("input[type=submit]")

        row = page.locator("#result_list tbody tr", has_text=short(run_id))
        assert row.locator(".field-call_arguments strong.amount").first.text_content() == "12499"
        row.get_by_role("link", name=tool).click()
        assert "Let me do that." in page.locator(".conversation").inner_text()
        page.fill("textarea[name=reason]", "customer identity verified")
        page.click("input[name=_approve]")
        assert f"Approved: {tool} for run {short(run_id)}" in page.locator("ul.messagelist").inner_text()
        assert page.locator("#result_list").count() == 0  # nothing else is waiting

        page.goto(f"{live_server.url}/admin/runs/run/{run_id}/change/")
        deadline = time.monotonic() + 60
        while page.locator("#run-status").inner_text() != "succeeded" and time.monotonic() < deadline:
            time.sleep(0.5)
            page.reload()
        assert page.locator("#run-status").inner_text() == "succeeded"
        assert "customer identity verified" in page.locator("#timeline").text_content()

    in_browser(supervise)

    approval.refresh_from_db()
    assert (approval.status, approval.decided_by) == (ApprovalStatus.CONSUMED, acme.ravi)
