"""In Chromium, under the Content-Security-Policy, the pages whose scripts do something (the run
timeline, the approval's keyboard shortcuts, Swagger UI) work and the browser refuses nothing."""

from __future__ import annotations

import pytest

from tests.admin.helpers import park_on_approval
from tests.admin.test_inbox_browser import in_browser

pytestmark = pytest.mark.django_db(transaction=True)


def test_in_chromium_the_pages_scripts_work_and_nothing_is_refused(live_server, acme):
    approval = park_on_approval(acme.asha, "refunder")

    def look(page):
        refused: list[str] = []
        page.on("console", lambda m: "Content Security Policy" in m.text and refused.append(m.text))
        page.goto(f"{live_server.url}/admin/login/?next=/admin/")
        page.fill("#id_username", "ravi")
        page.fill("#id_password", "pw")
        page.click("input[type=submit]")

        # The run page's timeline: a row opens on click (an inline script under the nonce).
        page.goto(f"{live_server.url}/admin/runs/run/{approval.run_id}/change/")
        row = page.locator("#timeline tbody.tl-row").first
        row.locator(".tl-summary").click()
        assert "open" in (row.get_attribute("class") or "")
        # The stylesheet in base_site.html applies (a class it defines).
        assert page.locator(".platform-nav a").first.evaluate("e => getComputedStyle(e).marginRight") != "0px"

        # The approval page's keyboard shortcut: R focuses the reason.
        page.goto(f"{live_server.url}/admin/approvals/approval/{approval.pk}/change/")
        page.keyboard.press("r")
        assert page.evaluate("document.activeElement.tagName") == "TEXTAREA"

        # Swagger UI draws the operations from the schema (its init script comes from ?script).
        page.goto(f"{live_server.url}/v1/docs")
        page.wait_for_selector(".opblock-summary-path")
        assert page.locator(".opblock").count() > 20

        assert refused == []

    in_browser(look)
