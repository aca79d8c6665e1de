"""The operators' desk in a real browser at 1366x768 (Playwright with Debian's Chromium): paused runs
by reason and the kill switches that are on show on the desk and in the top bar, without
scrolling, and each count leads to its list; a bulk action shows its preview before it acts."""

from __future__ import annotations

import pytest

from runs.controls import kill_switches, pausing
from runs.models import Run, RunStatus
from tests.admin.helpers import park_on_approval
from tests.admin.test_inbox_browser import in_browser

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_operator_sees_paused_runs_and_switches_on_the_desk_and_top_bar(live_server, acme):
    for reason in ["core banking degraded", "core banking degraded", "customer asked"]:
        run_id = park_on_approval(acme.asha, "refunder").run_id
        pausing.pause_run(run_id=run_id, actor=acme.ravi, reason=reason)
    waiting = [park_on_approval(acme.asha, "refunder").run_id for _ in range(2)]
    kill_switches.flip(
        actor=acme.ravi,
        tenant=acme.tenant,
        scope="tool",
        target=acme.tools["echo"].name,
        on=True,
        reason="leaks",
    )

    def operate(page):
        page.set_viewport_size({"width": 1366, "height": 768})
        page.goto(f"{live_server.url}/admin/login/?next=/admin/")
        page.fill("#id_username", "ravi")
        page.fill("#id_password", "pw")
        page.click("input[type=submit]")

        assert page.locator("#desk-paused").inner_text() == "3"
        assert page.locator("#desk-switches").inner_text() == "1"
        reasons = page.locator("tr.desk-paused-reason")
        cells = [[text.strip() for text in reasons.nth(n).locator("td").all_inner_texts()] for n in (0, 1)]
        assert cells == [["core banking degraded", "2"], ["customer asked", "1"]]
        for selector in ("#top-paused-runs", "#top-kill-switches-on", "#desk-paused", "#desk-switches"):
            box = page.locator(selector).bounding_box()
            assert box is not None and box["y"] + box["height"] <= 768, (selector, box)  # no scrolling
        assert page.locator("#top-paused-runs").inner_text() == "3 paused runs"
        assert page.locator("#top-kill-switches-on").inner_text() == "1 kill switches on"

        # count() does not wait: without waiting for the page it read the desk (0 rows) in CI.
        with page.expect_navigation():
            page.click("tr.desk-paused-reason >> nth=0 >> a")
        assert page.locator("#result_list tbody tr").count() == 2
        with page.expect_navigation():
            page.click("#top-kill-switches-on")
        assert "leaks" in page.locator("#result_list").inner_text()

        # A bulk pause of the waiting runs: first the preview, then the action.
        page.goto(f"{live_server.url}/admin/runs/bulkaction/add/")
        page.select_option("#id_kind", "pause")
        page.fill("#id_reason", "hold refunds")
        page.select_option("#id_agent", "refunder")
        with page.expect_navigation():  # all_inner_texts() does not wait either
            page.click("input[name=_save]")
        assert (
            "Preview: this would pause 2 runs now"
            in page.locator(".errornote, .errorlist").all_inner_texts()[-1]
        )
        with page.expect_navigation():
            page.click("input[name=_save]")
        assert "2 runs paused" in page.locator("ul.messagelist").inner_text()
        page.goto(f"{live_server.url}/admin/")
        assert page.locator("#desk-paused").inner_text() == "5"

    in_browser(operate)

    assert Run.objects.filter(pk__in=waiting, status=RunStatus.PAUSED).count() == 2
