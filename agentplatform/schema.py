"""OpenAPI post-processing: every operation documents the one error body and the statuses it answers."""

from __future__ import annotations

import re

from drf_spectacular import openapi

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {
                "code": {
                    "type": "string",
                    "description": "machine-readable, e.g. invalid, not_found, throttled",
                },
                "message": {"type": "string"},
                "fields": {
                    "type": "object",
                    "additionalProperties": True,
                    "description": "per field path, the list of what is wrong with it",
                },
            },
        }
    },
}

ERRORS = {
    "400": "Invalid input: malformed JSON, a bad field (see error.fields) or a bad query parameter",
    "401": "Not authenticated, or the token is invalid, expired or revoked",
    "403": "Authenticated but not allowed",
    "404": "No such object in the caller's tenant, or no such route",
    "405": "Method not allowed on this route",
    "406": "The Accept header asks for something other than JSON",
    "409": "Conflict with the object's current state",
    "413": "The request body is too large",
    "415": "The body is not application/json",
    "422": "The Idempotency-Key was used with a different body",
    "429": "Rate limit or quota reached; retry after Retry-After seconds",
    "500": "Unexpected server error (logged)",
}
BODY_ONLY = {"413", "415", "422"}


def add_error_responses(result, generator, request, public):
    """Add every documented error status (with the Error body) to every operation."""
    components = result.setdefault("components", {})
    components.setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    reference = {"$ref": "#/components/schemas/Error"}
    for path_item in result.get("paths", {}).values():
        for method, operation in path_item.items():
            responses = operation.setdefault("responses", {})
            for code, description in ERRORS.items():
                if code in BODY_ONLY and method not in ("post", "put", "patch"):
                    continue
                response = {
                    "description": description,
                    "content": {"application/json": {"schema": reference}},
                }
                if code == "429":
                    response["headers"] = {
                        "Retry-After": {"schema": {"type": "integer"}, "description": "seconds to wait"}
                    }
                responses.setdefault(code, response)
    return result


class AutoSchema(openapi.AutoSchema):
    """Name serializers nested in views after their view (every view has an InputSerializer)."""

    def get_serializer_name(self, serializer, direction):
        qualname = type(serializer).__qualname__
        if "." in qualname and not getattr(serializer, "_spectacular_annotation", None):
            return qualname.replace(".", "").replace("Serializer", "")
        return super().get_serializer_name(serializer, direction)

    def get_operation_id(self):
        """One id per view and method (`RunListApi.get` -> `run_list_get`): drf-spectacular's own
        ids come from the path, so a list and its detail route (`/v1/runs`, `/v1/runs/{id}`) collide."""
        name = type(self.view).__name__.removeprefix("_").removesuffix("Api")
        return f"{re.sub(r'(?<!^)(?=[A-Z])', '_', name).lower()}_{self.method.lower()}"
