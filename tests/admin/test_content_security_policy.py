"""Admin and docs pages carry a strict Content-Security-Policy, and their own scripts and styles still work.

Every inline script and style carries the response's nonce and no markup has a style attribute
(checked on every registered admin page); test_content_security_policy_browser.py runs the pages'
scripts in Chromium.
"""

from __future__ import annotations

import re

from core.middleware import DATA_POLICY
from tests.admin.test_pages import pages, seed

NONCE = re.compile(r"script-src 'self' 'nonce-([A-Za-z0-9_-]+)'")


def assert_strict(response, url: str) -> None:
    policy = response["Content-Security-Policy"]
    match = NONCE.search(policy)
    assert match, (url, policy)
    assert "unsafe-inline" not in policy and "unsafe-eval" not in policy
    assert f"style-src 'self' 'nonce-{match[1]}'" in policy
    assert "frame-ancestors 'none'" in policy and "object-src 'none'" in policy
    html = response.content.decode()
    for tag, attributes in re.findall(r"<(script|style)\b([^>]*)>", html):
        if tag == "script" and "src=" in attributes:
            continue
        assert f'nonce="{match[1]}"' in attributes, (url, tag, attributes)
    assert not re.search(r"<[^>]+\sstyle=", html), url
    assert not re.search(r"<[^>]+\son[a-z]+=", html), url  # no inline event handlers


def test_every_admin_page_has_a_nonce_policy_that_covers_its_inline_scripts_and_styles(
    client, operator, acme
):
    seed(acme)
    client.force_login(operator)
    checked = 0
    for url in ["/admin/", "/admin/login/", *(url for url, _ in pages(operator))]:
        response = client.get(url)
        if response.status_code == 200:
            assert_strict(response, url)
            checked += 1
    assert checked >= 40
    # A new nonce per response: one seen in a page cannot be reused by markup injected later.
    first, second = (NONCE.search(client.get("/admin/")["Content-Security-Policy"]) for _ in range(2))
    assert first and second and first[1] != second[1]


def test_the_docs_page_is_strict_and_data_answers_load_nothing(client, acme):
    assert_strict(client.get("/v1/docs"), "/v1/docs")
    script = client.get("/v1/docs?script=")
    assert script.status_code == 200 and script["Content-Type"].startswith("application/javascript")
    assert b"SwaggerUIBundle" in script.content
    # JSON, the key set and errors: a browser made to render one loads and runs nothing.
    for url in ["/v1/schema", "/.well-known/jwks.json", "/v1/runs", "/v1/no-such-thing"]:
        assert client.get(url)["Content-Security-Policy"] == DATA_POLICY, url
