"""The API's only request parser: JSON, bounded in size and depth, with text PostgreSQL can store.

DRF's JSONParser reads the body stream past Django's DATA_UPLOAD_MAX_MEMORY_SIZE check, accepts
NaN and Infinity, and lets a RecursionError (deeply nested arrays) and text that PostgreSQL
refuses (NUL, lone surrogates) through to the database, where each became an HTTP 500.
"""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from rest_framework import status
from rest_framework.exceptions import APIException, ParseError
from rest_framework.parsers import BaseParser, MultiPartParser
from rest_framework.renderers import JSONRenderer


class BodyTooLarge(APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "The request body is too large."
    default_code = "too_large"


def text_problem(text: str) -> str | None:
    """Why `text` cannot be stored (PostgreSQL text and jsonb refuse both), or None."""
    if "\x00" in text:
        return "must not contain NUL characters"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "must not contain lone surrogates (invalid Unicode)"
    return None


def check_json(value: Any, *, max_depth: int) -> tuple[str, str] | None:
    """The first (path, message) in a decoded value that JSON storage cannot take, or None.

    Text must be storable (text_problem), numbers finite, keys text, nesting at most `max_depth`;
    anything but mappings, lists, text, numbers, booleans and null (a YAML date, say) is refused.
    """
    stack: list[tuple[Any, int, str]] = [(value, 0, "")]
    while stack:
        item, depth, path = stack.pop()
        if depth > max_depth:
            return path, f"nested more than {max_depth} levels deep"
        if isinstance(item, str):
            problem = text_problem(item)
            if problem:
                return path, problem
        elif isinstance(item, float):
            if item != item or item in (float("inf"), float("-inf")):
                return path, "must be a finite number"
        elif isinstance(item, dict):
            for key, child in item.items():
                if not isinstance(key, str):
                    return path, f"keys must be text, not {type(key).__name__}"
                problem = text_problem(key)
                if problem:
                    return path, f"a key {problem}"
                stack.append((child, depth + 1, f"{path}.{key}" if path else key))
        elif isinstance(item, list):
            stack.extend((child, depth + 1, f"{path}[{i}]") for i, child in enumerate(item))
        elif item is not None and not isinstance(item, (bool, int)):
            return path, f"must be text, a number, a boolean, a list or a mapping, not {type(item).__name__}"
    return None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


class StrictJSONParser(BaseParser):
    media_type = "application/json"
    renderer_class = JSONRenderer

    def parse(self, stream, media_type=None, parser_context=None):
        limit = settings.API_MAX_BODY_BYTES
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise BodyTooLarge(f"The request body is larger than {limit} bytes.")
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        try:
            # parse_float: "1e400" would otherwise become Infinity.
            data = json.loads(
                raw.decode(encoding), parse_constant=_refuse_constant, parse_float=_finite_float
            )
        except RecursionError:
            raise ParseError(f"JSON nested more than {settings.API_MAX_JSON_DEPTH} levels deep") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
        problem = check_json(data, max_depth=settings.API_MAX_JSON_DEPTH)
        if problem:
            raise ParseError(f"{problem[0] or 'body'}: {problem[1]}")
        return data


def _finite_float(text: str) -> float:
    number = float(text)
    if number in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is too large for a number")
    return number


class BoundedMultiPartParser(MultiPartParser):
    """multipart/form-data for the few requests that carry files (a run's start): the whole body
    is held to API_MAX_UPLOAD_BYTES by its Content-Length before a byte is read (Django streams
    file parts to disk and bounds only the other fields, by DATA_UPLOAD_MAX_MEMORY_SIZE)."""

    def parse(self, stream, media_type=None, parser_context=None):
        request = (parser_context or {}).get("request")
        meta = request.META if request is not None else {}
        limit = settings.API_MAX_UPLOAD_BYTES
        try:
            length = int(meta.get("CONTENT_LENGTH") or 0)
        except ValueError:
            raise ParseError("Content-Length is not a number") from None
        if length <= 0:
            raise ParseError("a multipart body needs its Content-Length")
        if length > limit:
            raise BodyTooLarge(f"The request body is larger than {limit} bytes.")
        return super().parse(stream, media_type, parser_context)
