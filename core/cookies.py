"""A cookie jar that keeps nothing, for the HTTP clients a worker process shares.

One client serves every run of the process, whoever started it (HTTP tools: tools/transports.py;
model providers: llm/providers/http.py). A cookie one server sets must never ride along on the
next call, so their jars store and send none.
"""

from __future__ import annotations

import http.cookiejar


class _NoCookies(http.cookiejar.DefaultCookiePolicy):
    def set_ok(self, cookie, request) -> bool:
        return False

    def return_ok(self, cookie, request) -> bool:
        return False


def no_cookies() -> http.cookiejar.CookieJar:
    return http.cookiejar.CookieJar(policy=_NoCookies())
