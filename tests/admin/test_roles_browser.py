"""Each role, made only by `apply` of a configuration file, in a real browser: every page linked
from the index and the top bar (and from the pages those open) opens, nothing links to a 403.

Screenshots of the inbox, an approval and run pages go to $ADMIN_SCREENSHOTS (or the test's
temporary directory) for a person to look at.
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import pytest

from configuration.apply import apply_config
from runs.approval_effects import decide_approval
from runs.models import Run, RunStatus
from tenants.models import User
from tests.admin.helpers import park_on_approval
from tests.admin.test_inbox_browser import in_browser
from tests.conftest import drive

pytestmark = pytest.mark.django_db(transaction=True)

REFUND = {"amount": 12499, "currency": "INR", "transaction_id": "TXN-1001"}
PASSWORDS = {"sam": "pw-sam-supervisor", "sue": "pw-sue-support", "olga": "pw-olga-operator"}


def tenant_file() -> dict:
    return {
        "tenant": {
            "slug": "acme-roles",
            "name": "Acme Roles",
            "time_zone": "Asia/Kolkata",
            "daily_budget": 25.0,
        },
        "groups": [
            {"name": "supervisors", "roles": ["supervisor"]},
            {"name": "support", "roles": ["support"]},
            {"name": "operators", "roles": ["operator"]},
        ],
        "users": [
            {"username": "sam", "password": PASSWORDS["sam"], "groups": ["supervisors"]},
            {"username": "sue", "password": PASSWORDS["sue"], "groups": ["support"]},
            {"username": "olga", "password": PASSWORDS["olga"], "groups": ["operators"]},
        ],
        "model_endpoints": [
            {
                "name": "scripted",
                "kind": "scripted",
                "prices": {"input": 3.0, "cached_input": 0.3, "output": 15.0},
                "config": {
                    "turns": [
                        {
                            "text": "The customer was charged twice for TXN-1001. I will refund the "
                            "duplicate charge of 12499 INR.",
                            "tool_calls": [{"name": "platform__echo", "arguments": REFUND}],
                        },
                        {"text": "Refund issued; the dispute can be closed."},
                    ]
                },
            }
        ],
        "tool_servers": [{"name": "platform", "kind": "builtin"}],
        "tools": [
            {
                "server": "platform",
                "name": "echo",
                "enabled": True,
                "effect": "idempotent",
                "approval": "always",
            }
        ],
        "grants": [
            {"tool": "platform__echo", "use": ["group:support"], "approve": ["group:supervisors"]},
            {"agent": "refunder", "run": ["group:support"]},
        ],
        "agents": [
            {
                "name": "refunder",
                "versions": [
                    {
                        "model": "scripted",
                        "instructions": "Resolve card disputes.",
                        "tools": ["platform__echo"],
                        "limits": {"max_steps": 10, "max_cost_micros": 2_000_000},
                    }
                ],
                "aliases": {"prod": 1},
            }
        ],
    }


@pytest.fixture
def shots(tmp_path) -> Path:
    folder = Path(os.environ.get("ADMIN_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def by_apply(transactional_db):
    """The tenant and its three people, from the file only; one finished run, one waiting."""
    apply_config(tenant_file())
    sue = User.objects.get(username="sue")
    done = park_on_approval(sue, "refunder")
    decide_approval(
        approval_id=done.pk, user=User.objects.get(username="sam"), approve=True, reason="verified"
    )
    assert drive(done.run_id).status == RunStatus.SUCCEEDED
    waiting = park_on_approval(sue, "refunder")
    return {"finished": str(done.run_id), "waiting": str(waiting.run_id), "approval": str(waiting.pk)}


# Links that leave the pages a person reads, or change something when followed.
SKIP = re.compile(r"/logout/|/password_change/|/add/|/delete/|/history/|/permissions/|/autocomplete/|/watch/")


def crawl(page, base: str, *, depth: int = 2, limit: int = 80) -> dict[str, int]:
    """Open every admin page linked from the index and its top bar, then from those pages, once per
    path (filters and sorting of one list count once); the status each answered."""
    seen: dict[str, int] = {}
    frontier = ["/admin/"]
    for _ in range(depth + 1):
        found: list[str] = []
        for url in frontier:
            path = urlsplit(url).path
            if path in seen or len(seen) >= limit:
                continue
            response = page.goto(urljoin(base, url))
            seen[path] = response.status
            assert response.status == 200, (url, response.status)
            assert page.locator("#content").inner_text().strip(), url
            for href in page.eval_on_selector_all(
                "#header a[href], #content a[href], .platform-nav a[href]", "els => els.map(e => e.href)"
            ):
                parts = urlsplit(href)
                if parts.netloc == urlsplit(base).netloc and parts.path.startswith("/admin/"):
                    if not SKIP.search(parts.path) and parts.path not in seen:
                        found.append(parts.path + (f"?{parts.query}" if parts.query else ""))
        frontier = found
    return seen


def log_in(page, base: str, username: str) -> None:
    page.goto(f"{base}/admin/login/?next=/admin/")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORDS[username])
    page.click("input[type=submit]")
    assert page.locator(".platform-nav, #content").first.is_visible()


@pytest.mark.parametrize(
    "username, must_open, must_not_link",
    [
        (
            "sam",
            [
                "/admin/approvals/approval/",
                "/admin/runs/run/",
                "/usage/",
                "/admin/runs/run/{finished}/change/",
            ],
            [],
        ),
        ("sue", ["/admin/runs/run/", "/admin/runs/run/{finished}/change/"], ["/admin/approvals/", "/usage/"]),
        (
            "olga",
            ["/admin/tools/tool/", "/admin/tools/toolserver/", "/admin/tenants/secret/", "/usage/"],
            ["/admin/approvals/"],
        ),
    ],
)
def test_every_page_a_role_is_shown_opens(live_server, by_apply, username, must_open, must_not_link):
    opened: dict[str, int] = {}

    def visit(page):
        log_in(page, live_server.url, username)
        opened.update(crawl(page, live_server.url))

    in_browser(visit)

    paths = list(opened)
    for expected in must_open:
        expected = expected.format(**by_apply)
        assert any(expected in path for path in paths), (expected, paths)
    for hidden in must_not_link:
        assert not any(hidden in path for path in paths), (hidden, paths)
    assert len(paths) >= 4


def test_a_supervisor_sees_the_timeline_the_approval_and_a_self_updating_inbox(live_server, by_apply, shots):
    ready, added = threading.Event(), threading.Event()
    seen: dict = {}

    def supervise(page):
        page.set_viewport_size({"width": 1280, "height": 900})
        log_in(page, live_server.url, "sam")
        page.goto(f"{live_server.url}/admin/runs/run/{by_apply['finished']}/change/")
        timeline = page.locator("#timeline").inner_text()
        seen["timeline"] = timeline
        page.screenshot(path=str(shots / "run-finished.png"), full_page=True)
        page.click(".platform-nav a:text('Usage')")
        seen["usage"] = page.locator("#content-main").inner_text()
        page.screenshot(path=str(shots / "usage.png"), full_page=True)
        page.goto(f"{live_server.url}/admin/approvals/approval/{by_apply['approval']}/change/")
        seen["approval"] = page.locator("#content-main").inner_text()
        page.screenshot(path=str(shots / "approval.png"), full_page=True)
        page.goto(f"{live_server.url}/admin/approvals/approval/")
        seen["rows_before"] = page.locator("#result_list tbody tr").count()
        ready.set()
        assert added.wait(120)
        # No reload from here on: the page must notice the new approval itself.
        deadline = time.monotonic() + 30
        # Until the reloaded list shows the new row: while the page reloads, the list counts 0.
        while (
            page.locator("#result_list tbody tr").count() != seen["rows_before"] + 1
            and time.monotonic() < deadline
        ):
            time.sleep(0.25)
        seen["rows_after"] = page.locator("#result_list tbody tr").count()
        page.screenshot(path=str(shots / "inbox.png"), full_page=True)
        page.goto(f"{live_server.url}/admin/runs/run/{by_apply['waiting']}/change/")
        page.screenshot(path=str(shots / "run-waiting.png"), full_page=True)
        page.click("details.cancel-box summary")  # cancelling is secondary: folded below the timeline
        page.fill("#cancel-reason", "customer withdrew the dispute")
        page.once("dialog", lambda dialog: dialog.dismiss())
        page.click(".cancel-run-button")
        seen["after_dismiss"] = page.locator("#run-status").get_attribute("data-status")
        page.once("dialog", lambda dialog: dialog.accept())
        page.click(".cancel-run-button")
        page.wait_for_selector("ul.messagelist")
        seen["after_accept"] = page.locator("#run-status").get_attribute("data-status")

    failure: list[BaseException] = []

    def browse():
        try:
            in_browser(supervise, timeout=240)
        except BaseException as exc:  # handed to the test's thread
            failure.append(exc)
        finally:
            ready.set()

    runner = threading.Thread(target=browse)
    runner.start()
    assert ready.wait(180)
    if not failure:
        park_on_approval(User.objects.get(username="sue"), "refunder")
    added.set()
    runner.join(260)
    if failure:
        raise failure[0]

    assert "The customer was charged twice for TXN-1001" in seen["timeline"]
    assert "platform__echo" in seen["timeline"] and "USD " in seen["timeline"]
    assert "TXN-1001" in seen["timeline"]  # the tool's result
    assert "refunder v1" in seen["approval"] and "idempotent" in seen["approval"]
    assert "I will refund the duplicate charge" in seen["approval"] and "USD " in seen["approval"]
    assert seen["rows_after"] == seen["rows_before"] + 1
    assert "USD " in seen["usage"] and " micros" not in seen["usage"]
    assert seen["after_dismiss"] == "waiting_approval"
    assert seen["after_accept"] == "cancelled"
    assert Run.objects.get(pk=by_apply["waiting"]).status == RunStatus.CANCELLED
