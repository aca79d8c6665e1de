"""How a person reads a proposed tool call: which arguments are money, and one sentence of what it does.

Money arguments come from two places, the tool's input schema and the tool's configuration
(`money:`, for tools whose schema a provider owns). In the schema, a property with
`"format": "money"` is an amount in the currency of the call's `currency` argument when the schema
has one, else in the tenant's `currency`; `x-currency` names the code (`INR`) or the argument that
holds it (`currency`) explicitly. `money:` does the same as `x-currency`. The summary is the tool's
`summary:` template, where `{argument}`, `{input.key}` (the run's input) and `{result.<tool>.<key>}`
(the latest result of an earlier call in the run) are filled in, money formatted in its currency;
without a template, the tool's name and its arguments.
"""

from __future__ import annotations

import datetime as dt
import json
import re

from core.money import CURRENCY_CODE, amount

PLACEHOLDER = re.compile(r"\{([^{}]+)\}")
ISO_DAY = re.compile(r"^\d{4}-\d{2}-\d{2}")
# One date format wherever a person reads a day: 14 Jan 2025.
DAY_FORMAT = "%d %b %Y"


def money_arguments(tool) -> dict[str, str]:
    """Argument name -> a currency code or the name of the argument that holds it."""
    found: dict[str, str] = {}
    properties = (tool.input_schema or {}).get("properties") or {}
    if isinstance(properties, dict):
        for name, schema in properties.items():
            if not isinstance(schema, dict):
                continue
            if isinstance(schema.get("x-currency"), str):
                found[name] = schema["x-currency"]
            elif schema.get("format") == "money":
                found[name] = "currency" if "currency" in properties else _tenant_currency(tool)
    found.update(tool.money_arguments or {})
    return found


def _tenant_currency(tool) -> str:
    tenant = getattr(tool, "tenant", None)
    return getattr(tenant, "currency", None) or "USD"


def currency_of(source: str, arguments: dict) -> str | None:
    if CURRENCY_CODE.match(source):
        return source
    code = arguments.get(source)
    return code if isinstance(code, str) and CURRENCY_CODE.match(code) else None


def shown(value) -> str:
    """A value as text: dates in the one day format, structures as compact JSON."""
    if isinstance(value, str):
        if ISO_DAY.match(value):
            try:
                return dt.date.fromisoformat(value[:10]).strftime(DAY_FORMAT)
            except ValueError:
                return value
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def formatted_arguments(tool, arguments) -> dict[str, tuple[str, bool]]:
    """Each argument as a person reads it, and whether it is money."""
    if not isinstance(arguments, dict):
        return {}
    money = money_arguments(tool) if tool is not None else {}
    out: dict[str, tuple[str, bool]] = {}
    for name, value in arguments.items():
        code = currency_of(money[name], arguments) if name in money else None
        if code is not None and isinstance(value, int | float | str) and not isinstance(value, bool):
            out[name] = (amount(value, code), True)
        else:
            out[name] = (shown(value), False)
    return out


def result_value(result, key: str):
    """`key` of a stored tool result: its structured part, or its text when that is a JSON object."""
    if not isinstance(result, dict):
        return None
    for part in (result.get("structured"), result):
        if isinstance(part, dict) and key in part:
            return part[key]
    text = result.get("text")
    if isinstance(text, str) and text.lstrip().startswith("{"):
        try:
            parsed = json.loads(text)
        except ValueError:
            return None
        if isinstance(parsed, dict):
            return parsed.get(key)
    return None


def summary(tool, arguments, *, run_input=None, results: dict | None = None) -> str:
    """One sentence of what the call does. `results`: tool name -> its latest stored result."""
    readable = formatted_arguments(tool, arguments)
    template = getattr(tool, "summary", "") if tool is not None else ""
    if not template:
        action = (tool.remote_name if tool is not None else "call").replace("_", " ")
        parts = ", ".join(f"{name} {text}" for name, (text, _) in readable.items())
        return f"{action[:1].upper()}{action[1:]}" + (f": {parts}" if parts else "")

    def fill(match: re.Match) -> str:
        name = match.group(1)
        if name.startswith("input."):
            source = run_input if isinstance(run_input, dict) else {}
            value = source.get(name.removeprefix("input."))
        elif name.startswith("result."):
            tool_name, _, key = name.removeprefix("result.").rpartition(".")
            value = result_value((results or {}).get(tool_name), key)
        elif name in readable:
            return readable[name][0]
        else:
            value = None
        return "?" if value is None else shown(value)

    return PLACEHOLDER.sub(fill, template)
