"""Money as people read it: one format for budgets, costs and amounts in tool arguments.

Budgets, prices and costs are stored in micro-units of the platform currency (`PLATFORM_CURRENCY`,
the currency model providers bill in). A tenant names the currency its people read
(`tenant.currency`) and a fixed exchange rate from the platform currency (`tenant.exchange_rate`:
units of the tenant's currency per one unit of the platform's), both from its configuration file.
The rate is fixed on purpose: a cost shown yesterday reads the same today, and a budget does not
drift with the market; a tenant that wants a new rate applies a new file.

Amounts a tool's arguments carry (a refund of 12499 INR) are already in their own currency and are
only formatted, never converted.
"""

from __future__ import annotations

import re
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation

PLATFORM_CURRENCY = "USD"
MICROS = Decimal(1_000_000)
# ISO 4217 currencies whose minor unit is not the cent; every other code shows 2 decimals.
MINOR_DIGITS = {"JPY": 0, "KRW": 0, "VND": 0, "CLP": 0, "ISK": 0, "BHD": 3, "KWD": 3, "OMR": 3, "JOD": 3}
CURRENCY_CODE = re.compile(r"^[A-Z]{3}$")


def platform_money(micros: int | None) -> str:
    """Micro-units of the platform currency as `USD 0.0021`: at least 2 decimals, at most 6, never
    rounded (what operators and the platform's own prices read)."""
    if micros is None:
        return "—"
    whole, _, fraction = f"{Decimal(micros).scaleb(-6):,.6f}".rstrip("0").partition(".")
    return f"{PLATFORM_CURRENCY} {whole}.{fraction.ljust(2, '0')}"


def amount(value, code: str) -> str:
    """A sum in its own currency, as `INR 12,499.00`; a value that is not a number is shown as is."""
    try:
        number = Decimal(str(value))
    except (InvalidOperation, ValueError):
        return f"{code} {value}"
    if not number.is_finite():
        return f"{code} {value}"
    digits = MINOR_DIGITS.get(code, 2)
    # Under one minor unit (a model call of a fraction of a paisa) "INR 0.00" would say nothing.
    if number and abs(number) < Decimal(1).scaleb(-digits):
        tiny = number.quantize(Decimal(1).scaleb(-digits - 4), rounding=ROUND_HALF_UP).normalize()
        return f"{code} {tiny:f}"
    rounded = number.quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP)
    return f"{code} {rounded:,.{digits}f}"


def in_tenant_currency(micros: int, tenant) -> Decimal:
    """Platform micro-units in the tenant's currency at its fixed rate."""
    return Decimal(micros) / MICROS * Decimal(tenant.exchange_rate)


def money(micros: int | None, tenant=None) -> str:
    """A stored amount as the tenant's people read it: `INR 1,186.40`. Without a tenant, or for a
    tenant that reads the platform currency, the exact platform amount."""
    if micros is None:
        return "—"
    if tenant is None or tenant.currency == PLATFORM_CURRENCY:
        return platform_money(micros)
    return amount(in_tenant_currency(micros, tenant), tenant.currency)


def rate_note(tenant) -> str:
    """How the tenant's amounts were converted, for the foot of a page that shows them."""
    if tenant is None or tenant.currency == PLATFORM_CURRENCY:
        return ""
    return (
        f"{tenant.currency} at the configured fixed rate of {Decimal(tenant.exchange_rate).normalize():f} "
        f"per {PLATFORM_CURRENCY}"
    )
