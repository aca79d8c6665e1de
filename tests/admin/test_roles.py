"""Roles without a browser (the fast twin of test_roles_browser.py): users made only by `apply`
open every page their index and top bar link to, and are not shown links they cannot open."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import pytest

from tests.admin.test_roles_browser import PASSWORDS, SKIP, by_apply  # noqa: F401 (fixture)

pytestmark = pytest.mark.django_db(transaction=True)

LINK = re.compile(r'href="(/admin/[^"#]*)"')


def crawl(client, *, depth: int = 2) -> dict[str, int]:
    """The status of every admin page reachable in `depth` clicks from the index, once per path."""
    seen: dict[str, int] = {}
    frontier = ["/admin/"]
    for _ in range(depth + 1):
        found = []
        for url in frontier:
            path = urlsplit(url).path
            if path in seen:
                continue
            response = client.get(url.replace("&amp;", "&"))
            seen[path] = response.status_code
            if response.status_code == 200 and "text/html" in response["Content-Type"]:
                found += [u for u in LINK.findall(response.content.decode()) if not SKIP.search(u)]
        frontier = found
    return seen


@pytest.mark.parametrize("username", ["sam", "sue", "olga"])
def test_every_linked_page_opens_for_each_role(client, by_apply, username):  # noqa: F811
    assert client.login(username=username, password=PASSWORDS[username])

    statuses = crawl(client)

    assert {path: code for path, code in statuses.items() if code != 200} == {}
    assert len(statuses) >= 4


def test_each_role_sees_the_top_bar_links_it_can_open(client, by_apply):  # noqa: F811
    def nav(username):
        client.login(username=username, password=PASSWORDS[username])
        return [label for label, _ in client.get("/admin/").context["platform_nav"]]

    assert nav("sam") == ["Inbox", "Runs", "Usage"]
    assert nav("sue") == ["Runs"]
    assert nav("olga") == ["Runs", "Usage"]


def test_a_support_user_sees_the_runs_they_started_and_not_the_tenants_usage(client, by_apply):  # noqa: F811
    client.login(username="sue", password=PASSWORDS["sue"])

    assert client.get(f"/admin/runs/run/{by_apply['finished']}/change/").status_code == 200
    assert client.get("/admin/approvals/approval/").status_code == 403
    index = client.get("/admin/").content.decode()
    assert "/usage/" not in index and "/admin/approvals/" not in index
