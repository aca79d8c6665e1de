"""Refuse API requests whose path or query string carries text PostgreSQL cannot store (NUL)."""

from __future__ import annotations

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
