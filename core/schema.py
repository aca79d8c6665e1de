"""OpenAPI: the one error body, the error statuses each operation can answer, JSON object fields.

Statuses every operation of its kind can answer are added by `add_error_responses` (a
post-processing hook); those that depend on what the service does (409, 422, 429, a 404 on a
route without path parameters) are declared by the view with `errors(...)`. The schema must stay
true: `tests/api/test_schema.py` checks its shape, `tests/api/test_schemathesis.py` that the
server answers as it says, `tests/api/test_generated_client.py` that a generated client works.
"""

from __future__ import annotations

import re

from drf_spectacular import openapi
from drf_spectacular.utils import OpenApiResponse, extend_schema_field
from rest_framework import serializers

ERROR_SCHEMA = {
    "type": "object",
    "description": "Every error under /v1/ has this body (core/errors.py).",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {
                "code": {
                    "type": "string",
                    "description": "machine-readable, e.g. invalid, not_found, not_permitted, "
                    "approval_approved, idempotency_key_reused, throttled",
                },
                "message": {"type": "string", "description": "for people"},
                "fields": {
                    "type": "object",
                    "additionalProperties": True,
                    "description": "validation errors only: per field, the list of what is wrong with "
                    "it (an object of the same shape for a field that is itself an object)",
                    "example": {"limit": ["Ensure this value is less than or equal to 200."]},
                },
            },
        }
    },
}
ERROR_REF = {"$ref": "#/components/schemas/Error"}

ERRORS = {
    400: "Invalid input: malformed JSON, a bad field (see error.fields) or a bad query parameter",
    401: "Not authenticated, or the token is invalid, expired or revoked",
    403: "Authenticated but not allowed",
    404: "No such object in the caller's tenant",
    406: "The Accept header asks for something other than JSON",
    409: "Conflict with the object's current state",
    413: "The request body is too large",
    415: "The body is not application/json",
    422: "The Idempotency-Key was used with a different body",
    429: "Rate limit or quota reached; retry after Retry-After seconds",
    500: "Unexpected server error (logged)",
}
RETRY_AFTER = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds to wait"}}


def _error_response(code: int, description: str) -> dict:
    response = {"description": description, "content": {"application/json": {"schema": ERROR_REF}}}
    if code == 429:
        response["headers"] = RETRY_AFTER
    return response


def errors(declared: dict[int, str]) -> dict[int, OpenApiResponse]:
    """The error statuses a view's service can answer beyond the common ones, with why: put them
    into extend_schema(responses=...). The hook below gives them the Error body."""
    return {code: OpenApiResponse(response=ERROR_REF, description=why) for code, why in declared.items()}


def add_error_responses(result, generator, request, public):
    """Give every operation the error statuses its kind can answer, all with the Error body.

    Every operation: 400 (a NUL in the query string is refused before routing), 401, 406, 500.
    The tenant's API (default authentication, token or session): 403 (a user of no tenant, a
    missing grant, a session without its CSRF token). Path parameters: 404 (no such object, or a
    value the route does not take). A request body: 413 and 415.
    """
    result.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    for path, path_item in result.get("paths", {}).items():
        for operation in path_item.values():
            responses = operation.setdefault("responses", {})
            codes = {400, 401, 406, 500}
            if any("cookieAuth" in scheme for scheme in operation.get("security", [])):
                # The default authentication: the tenant's API (require_tenant, grants, CSRF).
                codes.add(403)
            if "{" in path:
                codes.add(404)
            if "requestBody" in operation:
                codes |= {413, 415}
            for code in sorted(codes):
                responses.setdefault(str(code), _error_response(code, ERRORS[code]))
            if "429" in responses:  # declared by the view with errors(...)
                responses["429"].setdefault("headers", RETRY_AFTER)
            operation["responses"] = dict(sorted(responses.items()))
    return result


@extend_schema_field({"type": "object", "additionalProperties": True})
class JsonObjectField(serializers.JSONField):
    """A JSON object in answers (input, metadata, limits, arguments, ...), typed as one in the schema."""


class JsonObjectInput(serializers.DictField):
    """A JSON object in requests: anything else is a 400 with the field's name."""

    default_error_messages = {"not_a_dict": "Expected a JSON object but got {input_type}."}


class AutoSchema(openapi.AutoSchema):
    def get_operation_id(self):
        """Views name their operations (start_run, approve, ...). A view that does not gets one id
        per view and method (`RunListApi.get` -> `run_list_get`): drf-spectacular's own ids come from
        the path, so a list and its detail route (`/v1/runs`, `/v1/runs/{id}`) would collide."""
        name = type(self.view).__name__.removeprefix("_").removesuffix("Api")
        return f"{re.sub(r'(?<!^)(?=[A-Z])', '_', name).lower()}_{self.method.lower()}"
