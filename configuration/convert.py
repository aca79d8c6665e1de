"""Converters from YAML values to model field values, one per kind of field."""

from __future__ import annotations

import decimal
import re
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import jsonschema
from django.contrib.auth.validators import UnicodeUsernameValidator
from django.core.exceptions import ValidationError
from django.core.validators import URLValidator, validate_email, validate_slug

from core.api import MONEY_MAX_MICROS
from core.parsers import check_json, text_problem
from tenants.models import validate_time_zone
from tools.origins import OriginError, split_host_port

MICROS = 1_000_000


# --- converters: raise _Invalid; messages never echo values that could be secrets ----------------


class _Invalid(Exception):
    def __init__(self, message: str, at: str = ""):
        super().__init__(message)
        self.message = message
        self.at = at


Convert = Callable[[Any], Any]


TEXT_MAX = 10_000  # free text (descriptions, secret values) without a column limit of its own
INT_MAX = 2**31 - 1  # PositiveIntegerField
JSON_DEPTH_MAX = 64


def _text(max_length: int = TEXT_MAX, *, empty: bool = True) -> Convert:
    def convert(value: Any) -> str:
        if not isinstance(value, str):
            raise _Invalid("must be text")
        if not empty and not value.strip():
            raise _Invalid("must not be empty")
        if len(value) > max_length:
            raise _Invalid(f"must be at most {max_length} characters")
        problem = text_problem(value)
        if problem:
            raise _Invalid(problem)
        return value

    return convert


def _slug(max_length: int) -> Convert:
    def convert(value: Any) -> str:
        text = _text(max_length, empty=False)(value)
        try:
            validate_slug(text)
        except ValidationError:
            raise _Invalid("must be a slug: letters, digits, hyphens and underscores") from None
        return text

    return convert


def _django(validator: Callable[[Any], None], message: str, max_length: int = 0) -> Convert:
    def convert(value: Any) -> str:
        text = _text(max_length, empty=False)(value)
        try:
            validator(text)
        except ValidationError:
            raise _Invalid(message) from None
        return text

    return convert


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if value in ("true", "false"):  # what ${VAR} substitution produces
        return value == "true"
    raise _Invalid("must be true or false")


def _decimal(value: Any) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, (int, float, str, Decimal)):
        raise _Invalid("must be a number")
    try:
        number = Decimal(str(value).strip())
    except decimal.InvalidOperation:
        raise _Invalid("must be a number") from None
    if not number.is_finite():
        raise _Invalid("must be a finite number")
    return number


def _within(number: Decimal, minimum: Decimal | int, maximum: Decimal | int) -> Decimal:
    # Compared before any conversion: int(Decimal("1e999999999")) alone would never finish.
    if number < minimum:
        raise _Invalid(f"must be at least {minimum}")
    if number > maximum:
        raise _Invalid(f"must be at most {maximum}")
    return number


def _int(minimum: int = 1, maximum: int = INT_MAX) -> Convert:
    def convert(value: Any) -> int:
        number = _within(_decimal(value), minimum, maximum)
        if number != number.to_integral_value():
            raise _Invalid("must be a whole number")
        return int(number)

    return convert


def _seconds(maximum: int) -> Convert:
    """A duration in seconds, greater than 0 and at most `maximum`."""

    def convert(value: Any) -> float:
        number = _within(_decimal(value), 0, maximum)
        if number <= 0:
            raise _Invalid("must be greater than 0")
        return float(number)

    return convert


_DURATION = re.compile(r"(?:(\d{1,9})d)?(?:(\d{1,9})h)?(?:(\d{1,9})m)?(?:(\d{1,9})s)?")
_DURATION_UNITS = (86400, 3600, 60, 1)


def _duration(maximum: int) -> Convert:
    """Whole seconds (`1800`) or a duration (`30m`, `2h`, `1h30m`, `1d`), at least 1 s, at most `maximum`."""

    def convert(value: Any) -> int:
        if isinstance(value, str) and value.strip() and not value.strip().isdigit():
            match = _DURATION.fullmatch(value.strip())
            if match is None or not any(match.groups()):
                raise _Invalid(
                    'must be whole seconds or a duration such as "90s", "30m", "2h", "1h30m", "1d"'
                )
            seconds = sum(int(n) * unit for n, unit in zip(match.groups(), _DURATION_UNITS, strict=True) if n)
        else:
            seconds = _int(0, INT_MAX)(value)
        if seconds < 1:
            raise _Invalid("must be at least 1 second")
        if seconds > maximum:
            raise _Invalid(f"must be at most {maximum} seconds")
        return seconds

    return convert


def _not_negative(value: Any, maximum: Decimal | int) -> Decimal:
    number = _decimal(value)
    if number < 0:
        raise _Invalid("must not be negative")
    return _within(number, 0, maximum)


def _non_negative(maximum: int) -> Convert:
    return lambda value: float(_not_negative(value, maximum))


def _money(value: Any) -> int:
    """Currency units to integer micros; refuse what micros cannot hold exactly."""
    micros = _not_negative(value, Decimal(MONEY_MAX_MICROS) / MICROS) * MICROS
    if micros != micros.to_integral_value():
        raise _Invalid("must have at most 6 decimal places")
    return int(micros)


PRICE_MAX = Decimal("99999999.9999")  # DecimalField(max_digits=12, decimal_places=4)


def _price(value: Any) -> Decimal:
    number = _not_negative(value, PRICE_MAX)
    if number != number.quantize(Decimal("0.0001"), rounding=decimal.ROUND_DOWN):
        raise _Invalid("must have at most 4 decimal places")
    return number


def _choice(options: list[str]) -> Convert:
    def convert(value: Any) -> str:
        if value not in options:
            raise _Invalid(f"must be one of {', '.join(options)}")
        return value

    return convert


def _nullable(inner: Convert) -> Convert:
    return lambda value: None if value is None else inner(value)


def _json(value: Any) -> Any:
    """A value stored as JSON: finite numbers, text keys, storable text, bounded nesting."""
    problem = check_json(value, max_depth=JSON_DEPTH_MAX)
    if problem:
        at, message = problem
        raise _Invalid(message, at=f".{at}" if at and not at.startswith("[") else at)
    return value


def _compat(value: Any) -> dict:
    """An endpoint's compatibility settings or sampling defaults (llm/compat.py): a mapping here;
    each key is checked against the endpoint's kind with the whole entry (schema._check_endpoint)."""
    if not isinstance(value, dict):
        raise _Invalid("must be a mapping")
    return dict(value)


def _mapping(value: Any) -> dict:
    if not isinstance(value, dict):
        raise _Invalid("must be a mapping")
    return _json(value)


LIST_MAX = 1000


def _text_list(value: Any) -> list[str]:
    if not isinstance(value, list):
        raise _Invalid("must be a list")
    if len(value) > LIST_MAX:
        raise _Invalid(f"must have at most {LIST_MAX} items")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            raise _Invalid("must be non-empty text", at=f"[{i}]")
        try:
            _text(1000)(item)
        except _Invalid as exc:
            raise _Invalid(exc.message, at=f"[{i}]") from None
    return value


# A region's name (settings.REGION, REGION_PEERS): lower-case letters, digits and dashes.
_REGION_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,39}")


def _region_name(value: Any) -> str:
    if not isinstance(value, str) or not _REGION_NAME.fullmatch(value):
        raise _Invalid("must be a region's name: lower-case letters, digits and dashes, at most 40")
    return value


def _region_names(value: Any) -> list[str]:
    if not isinstance(value, list) or not value:
        raise _Invalid("must be a list of region names, the home among them")
    if len(value) > LIST_MAX:
        raise _Invalid(f"must have at most {LIST_MAX} items")
    for i, item in enumerate(value):
        try:
            _region_name(item)
        except _Invalid as exc:
            raise _Invalid(exc.message, at=f"[{i}]") from None
        if item in value[:i]:
            raise _Invalid(f"{item!r} is listed twice", at=f"[{i}]")
    return value


def _time_zone(value: Any) -> str:
    text = _text(64, empty=False)(value)
    try:
        validate_time_zone(text)
    except ValidationError:
        raise _Invalid(f"unknown time zone {text!r}; use an IANA name such as Asia/Kolkata") from None
    return text


def _approval_rule(value: Any) -> str:
    """Text; whether it is a rule for its tool is checked with the tool's name (schema._check_tool)."""
    if not isinstance(value, str):
        raise _Invalid('must be text: "never", "always" or a Cedar @approval policy (docs/policies.md)')
    return _text(TEXT_MAX, empty=False)(value)


def _json_schema(value: Any) -> dict:
    schema = _mapping(value)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise _Invalid(f"not a valid JSON schema: {exc.message}") from None
    return schema


def _spec_list(value: Any) -> list[dict]:
    if not isinstance(value, list):
        raise _Invalid("must be a list of agent specs")
    for i, spec in enumerate(value):
        if not isinstance(spec, dict):
            raise _Invalid("must be a mapping (an agent spec)", at=f"[{i}]")
    return _json(value)


def _aliases(value: Any) -> dict[str, int]:
    aliases = _mapping(value)
    for name, number in aliases.items():
        try:
            _slug(50)(name)
            aliases[name] = _int(1)(number)
        except _Invalid as exc:
            raise _Invalid(exc.message, at=f".{name}") from None
    return aliases


def _hosts(value: Any) -> list[str]:
    """Egress hosts: `host`, `host:port` or `*.domain`, stored lower-cased."""
    hosts = _text_list(value)
    for i, entry in enumerate(hosts):
        try:
            split_host_port(entry)
        except OriginError as exc:
            raise _Invalid(str(exc), at=f"[{i}]") from None
    return [entry.strip().lower() for entry in hosts]


_url = _django(URLValidator(schemes=["http", "https"]), "must be an http(s) URL", 500)
_email = _django(validate_email, "must be an email address", 254)
_username = _django(UnicodeUsernameValidator(), "must be a username: letters, digits and @.+-_", 150)


# --- how people read a tool's calls and a tenant's money (tools/display.py, core/money.py) ---

CURRENCY_CODE = re.compile(r"^[A-Z]{3}$")
PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
PLACEHOLDER_NAME = re.compile(r"^(input\.|result\.[A-Za-z0-9_.-]+?\.)?[A-Za-z0-9_-]+$")


def _currency(value: Any) -> str:
    if not isinstance(value, str) or not CURRENCY_CODE.match(value):
        raise _Invalid("must be an ISO 4217 code of three capital letters, like INR")
    return value


def _exchange_rate(value: Any) -> Decimal:
    rate = _not_negative(value, Decimal("1000000"))
    if rate == 0:
        raise _Invalid("must be more than 0: units of the tenant's currency per one USD")
    if rate != rate.quantize(Decimal("0.000001"), rounding=decimal.ROUND_DOWN):
        raise _Invalid("must have at most 6 decimal places")
    return rate


def _summary(value: Any) -> str:
    """`Refund {amount} on {transaction_id} to {input.customer_email}`: every {…} names an
    argument, `input.<key>` of the run's input or `result.<tool>.<key>` of an earlier result."""
    text = _text(500, empty=False)(value)
    for name in PLACEHOLDER.findall(text):
        if not PLACEHOLDER_NAME.match(name):
            raise _Invalid(f"{{{name}}}: a placeholder is {{argument}}, {{input.key}} or {{result.tool.key}}")
    if PLACEHOLDER.sub("", text).count("{") or PLACEHOLDER.sub("", text).count("}"):
        raise _Invalid("has an unmatched { or }")
    return text


def _money_arguments(value: Any) -> dict:
    """`{amount: currency}` (the argument that names the code) or `{amount: INR}` (a fixed code)."""
    mapping = _mapping(value)
    for key, currency in mapping.items():
        if not isinstance(currency, str) or not currency:
            raise _Invalid("must name a currency code (INR) or the argument that holds it", at=f".{key}")
    return mapping


MiB = 1024 * 1024
# run_python's `sandbox` section: each limit's file name, its stored name (sandbox.limits.Limits),
# the conversion, and the unit that makes bytes of it. The bounds are what one call may ask for;
# the runner's ceiling and the tenant's cap (tools.SandboxCaps) may hold it lower.
SANDBOX_LIMITS: dict[str, tuple[str, Convert, int]] = {
    "wall_seconds": ("wall_seconds", _seconds(300), 1),
    "cpu_seconds": ("cpu_seconds", _seconds(300), 1),
    "cores": ("cores", _seconds(16), 1),
    "memory_mib": ("memory_bytes", _int(16, 64 * 1024), MiB),
    "processes": ("processes", _int(8, 4096), 1),
    "tmp_mib": ("tmp_bytes", _int(1, 16 * 1024), MiB),
    "output_mib": ("output_bytes", _int(1, 1024), MiB),
    "output_files": ("output_files", _int(1, 1000), 1),
    "stdout_kib": ("stdout_bytes", _int(1, 64 * 1024), 1024),
}
SANDBOX_PRICES = {"cpu_second": "cpu_second_micros", "gib_second": "gib_second_micros"}


def _sandbox(value: Any) -> dict:
    """run_python's limits and prices: {"limits": {stored name: value}, "prices": {...micros}}."""
    if not isinstance(value, dict):
        raise _Invalid("must be a mapping")
    known = (*SANDBOX_LIMITS, "prices")
    out: dict = {"limits": {}, "prices": {}}
    for key, raw in value.items():
        if key not in known:
            raise _Invalid(f"unknown field; one of {', '.join(known)}", at=f".{key}")
        if key == "prices":
            if not isinstance(raw, dict):
                raise _Invalid("must be a mapping", at=".prices")
            for name, price in raw.items():
                if name not in SANDBOX_PRICES:
                    raise _Invalid(f"unknown price; one of {', '.join(SANDBOX_PRICES)}", at=f".prices.{name}")
                try:
                    out["prices"][SANDBOX_PRICES[name]] = _money(price)
                except _Invalid as exc:
                    raise _Invalid(exc.message, at=f".prices.{name}") from None
            continue
        target, convert, unit = SANDBOX_LIMITS[key]
        try:
            converted = convert(raw)
        except _Invalid as exc:
            raise _Invalid(exc.message, at=f".{key}") from None
        out["limits"][target] = converted * unit if unit != 1 else converted
    return {part: values for part, values in out.items() if values}
