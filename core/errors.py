"""One domain error type and one JSON error body for the whole API.

Body: {"error": {"code": "...", "message": "...", "fields": {...}}}

Every answer under /v1/ that is not a success has this body: refusals of the services
(DomainError), DRF's own (validation, authentication, throttling, method not allowed, unsupported
media type), routes that match nothing, oversized or malformed bodies, and unexpected server
errors (logged with their traceback here, answered without it).
"""

from __future__ import annotations

import logging

from django.http import JsonResponse
from django.views import defaults
from django.views.decorators.csrf import csrf_exempt
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler
from rest_framework.views import set_rollback

logger = logging.getLogger("core.errors")

API_PREFIX = "/v1/"


class DomainError(Exception):
    """A refused operation, with a machine-readable code and an HTTP status for the API."""

    def __init__(
        self,
        message: str,
        *,
        code: str = "invalid",
        status: int = 400,
        fields: dict | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status
        self.fields = fields or {}
        self.retry_after = retry_after


class NotFound(DomainError):
    def __init__(self, what: str = "object"):
        super().__init__(f"{what} not found", code="not_found", status=404)


class Conflict(DomainError):
    def __init__(self, message: str, *, code: str = "conflict"):
        super().__init__(message, code=code, status=409)


class IllegalTransition(Conflict):
    """A status change its transition map does not allow, or that lost a race to another writer."""

    def __init__(self, what: str, old: str, new: str):
        super().__init__(f"{what} cannot go from {old} to {new}", code="illegal_transition")


class Forbidden(DomainError):
    def __init__(self, message: str, *, code: str = "forbidden"):
        super().__init__(message, code=code, status=403)


def error_body(code: str, message: str, fields: dict | None = None) -> dict:
    body: dict[str, object] = {"code": code, "message": message}
    if fields:
        body["fields"] = fields
    return {"error": body}


def _flatten(detail) -> dict:
    if isinstance(detail, dict):
        return {
            key: [str(m) for m in value]
            if isinstance(value, list)
            else _flatten(value)
            if isinstance(value, dict)
            else [str(value)]
            for key, value in detail.items()
        }
    return {"non_field_errors": [str(m) for m in detail]} if isinstance(detail, list) else {}


def exception_handler(exc, context):
    if isinstance(exc, DomainError):
        refusal = Response(error_body(exc.code, exc.message, exc.fields), status=exc.status)
        if exc.retry_after is not None:
            refusal["Retry-After"] = str(exc.retry_after)
        return refusal
    response = drf_exception_handler(exc, context)
    if response is None:
        # Not an API error: a bug or an outage. The traceback goes to the log, never to the caller.
        request = context.get("request")
        logger.error(
            "unexpected error in %s %s",
            getattr(request, "method", "?"),
            getattr(request, "path", "?"),
            exc_info=exc,
        )
        set_rollback()
        return Response(
            error_body("internal_error", "An unexpected error occurred; it has been logged."),
            status=status.HTTP_500_INTERNAL_SERVER_ERROR,
        )
    if isinstance(exc, exceptions.ValidationError):
        response.data = error_body("invalid", "The request has invalid fields.", _flatten(exc.detail))
    elif isinstance(exc, exceptions.APIException):
        codes = exc.get_codes()
        code = codes if isinstance(codes, str) else "error"
        if response.status_code == status.HTTP_404_NOT_FOUND:
            code = "not_found"
        response.data = error_body(code, str(exc.detail))
    return response


# --- Django-level answers (outside DRF views) for API paths ---------------------------------------


def _is_api(request) -> bool:
    return request.path.startswith(API_PREFIX)


def json_error(code: str, message: str, status_code: int) -> JsonResponse:
    return JsonResponse(error_body(code, message), status=status_code)


@csrf_exempt
def unmatched_route(request, *args, **kwargs) -> JsonResponse:
    """The last /v1/ route: a JSON 404 whatever DEBUG says (Django's technical 404 page is HTML)."""
    return json_error("not_found", f"no API route {request.path}", 404)


def bad_request(request, exception, template_name="400.html"):
    if not _is_api(request):
        return defaults.bad_request(request, exception, template_name)
    # Django raises RequestDataTooBig (a SuspiciousOperation) past DATA_UPLOAD_MAX_MEMORY_SIZE.
    if type(exception).__name__ == "RequestDataTooBig":
        return json_error("too_large", "The request body is too large.", 413)
    return json_error("bad_request", "The request could not be read.", 400)


def permission_denied(request, exception, template_name="403.html"):
    if not _is_api(request):
        return defaults.permission_denied(request, exception, template_name)
    return json_error("forbidden", "You may not do this.", 403)


def page_not_found(request, exception, template_name="404.html"):
    if not _is_api(request):
        return defaults.page_not_found(request, exception, template_name)
    return json_error("not_found", f"no API route {request.path}", 404)


def server_error(request, template_name="500.html"):
    if not _is_api(request):
        return defaults.server_error(request, template_name)
    return json_error("internal_error", "An unexpected error occurred; it has been logged.", 500)
