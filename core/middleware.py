"""Refuse API requests whose path or query string carries text PostgreSQL cannot store (NUL), and
give every response a Content-Security-Policy."""

from __future__ import annotations

import secrets

from core.errors import API_PREFIX, json_error
from core.parsers import text_problem


class ApiInputGuard:
    """Query parameters reach filters and lookups unparsed; a NUL in one made PostgreSQL raise (HTTP 500)."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if request.path.startswith(API_PREFIX):
            problem = text_problem(request.path) and "the path"
            for key, values in request.GET.lists():
                if problem:
                    break
                if text_problem(key) or any(text_problem(value) for value in values):
                    problem = f"query parameter {key!r}"
            if problem:
                return json_error(
                    "bad_request",
                    f"{problem} contains characters that are not allowed (NUL or invalid Unicode)",
                    400,
                )
        return self.get_response(request)


# Pages (the admin, /v1/docs, error pages): scripts and styles from our own origin, and inline ones
# only with this response's nonce (templates write nonce="{{ request.csp_nonce }}"), so markup
# injected into a page (a tool's output, a run's input) cannot run or restyle it. No inline style
# attributes either: the CSSOM (element.style in scripts) is not blocked, markup is. Swagger UI
# fetches the schema from this origin and draws its icons as data: images.
PAGE_POLICY = (
    "default-src 'none'; script-src 'self' 'nonce-{nonce}'; style-src 'self' 'nonce-{nonce}'; "
    "img-src 'self' data:; font-src 'self'; connect-src 'self'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'; object-src 'none'"
)
# Everything else (JSON, the run stream, artifact downloads, the key set): nothing in it may load or
# run anything if a browser is made to render it (an artifact that is an HTML file, say).
DATA_POLICY = "default-src 'none'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"


class ContentSecurityPolicy:
    """A nonce per request for the templates' inline scripts and styles, and the policy that allows
    them and nothing else inline. A response that sets its own policy keeps it."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        nonce = request.csp_nonce = secrets.token_urlsafe(18)
        response = self.get_response(request)
        if "Content-Security-Policy" not in response:
            page = response.get("Content-Type", "").startswith("text/html")
            response["Content-Security-Policy"] = PAGE_POLICY.format(nonce=nonce) if page else DATA_POLICY
        return response
