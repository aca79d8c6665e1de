"""One domain error type and one JSON error body for the whole API.

Body: {"error": {"code": "...", "message": "...", "fields": {...}}}
"""
from __future__ import annotations

from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler


class DomainError(Exception):
    """A refused operation, with a machine-readable code and an HTTP status for the API."""

    def __init__(self, message: str, *, code: str = "invalid", status: int = 400,
                 fields: dict | None = None, retry_after: int | None = None):
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


class Forbidden(DomainError):
    def __init__(self, message: str, *, code: str = "forbidden"):
        super().__init__(message, code=code, status=403)


def error_body(code: str, message: str, fields: dict | None = None) -> dict:
    body = {"code": code, "message": message}
    if fields:
        body["fields"] = fields
    return {"error": body}


def _flatten(detail) -> dict:
    if isinstance(detail, dict):
        return {key: [str(m) for m in value] if isinstance(value, list) else _flatten(value)
                if isinstance(value, dict) else [str(value)] for key, value in detail.items()}
    return {"non_field_errors": [str(m) for m in detail]} if isinstance(detail, list) else {}


def exception_handler(exc, context):
    if isinstance(exc, DomainError):
        response = Response(error_body(exc.code, exc.message, exc.fields), status=exc.status)
        if exc.retry_after is not None:
            response["Retry-After"] = str(exc.retry_after)
        return response
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, exceptions.ValidationError):
        response.data = error_body("invalid", "The request has invalid fields.", _flatten(exc.detail))
    elif isinstance(exc, exceptions.APIException):
        code = exc.get_codes() if isinstance(exc.get_codes(), str) else "error"
        if response.status_code == status.HTTP_404_NOT_FOUND:
            code = "not_found"
        response.data = error_body(code, str(exc.detail))
    return response
