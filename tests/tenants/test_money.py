"""Money as people read it: a tenant's currency at its fixed rate, amounts in tool arguments, the
configuration that says so, and /v1/usage saying which currency and when a day is over its limit."""

from __future__ import annotations

from decimal import Decimal
from types import SimpleNamespace

import pytest
from rest_framework.test import APIClient

from budgets import services as budgets
from configuration.apply import apply_config
from core.money import amount, money
from tenants.models import Tenant
from tests import factories
from tests.configuration.test_apply import SLUG, config, rejected
from tools.display import formatted_arguments, summary
from tools.models import Tool

pytestmark = pytest.mark.django_db


def test_amounts_read_in_their_currency():
    assert amount(12499, "INR") == "INR 12,499.00"
    assert amount("12499.5", "INR") == "INR 12,499.50"
    assert amount(1500, "JPY") == "JPY 1,500"
    assert amount(Decimal("0.0012"), "INR") == "INR 0.0012"  # under a paisa, still not "0.00"
    assert amount("twelve", "INR") == "INR twelve"


def test_stored_micros_show_in_the_tenants_currency_at_its_fixed_rate():
    inr = SimpleNamespace(currency="INR", exchange_rate=Decimal("83.25"))
    assert money(2_000_000, inr) == "INR 166.50"
    assert money(2_000_000) == "USD 2.00"
    assert money(14_294) == "USD 0.014294"  # the platform's own amounts stay exact


def test_money_arguments_come_from_the_schema_or_the_configuration():
    tool = SimpleNamespace(
        input_schema={"properties": {"total": {"type": "number", "x-currency": "EUR"}}},
        money_arguments={"amount": "currency"},
        summary="",
        remote_name="issue_refund",
    )
    readable = formatted_arguments(
        tool, {"total": 10, "amount": 12499, "currency": "INR", "on": "2025-01-14"}
    )
    assert readable["total"] == ("EUR 10.00", True)
    assert readable["amount"] == ("INR 12,499.00", True)
    assert readable["on"] == ("14 Jan 2025", False)
    assert summary(tool, {"amount": 5, "currency": "INR"}) == "Issue refund: amount INR 5.00, currency INR"


def test_apply_stores_currency_rate_summary_and_money_arguments():
    data = config()
    data["tenant"].update(currency="INR", exchange_rate=83.25)
    data["tools"][0].update(summary="Echo {amount} for {input.customer}", money={"amount": "INR"})
    apply_config(data)
    tenant = Tenant.objects.get(slug=SLUG)
    assert (tenant.currency, tenant.exchange_rate) == ("INR", Decimal("83.25"))
    echo = Tool.objects.get(tenant=tenant, name="platform__echo")
    assert echo.summary == "Echo {amount} for {input.customer}" and echo.money_arguments == {"amount": "INR"}


@pytest.mark.parametrize(
    "tenant_fields, tool_fields, path, message",
    [
        ({"currency": "rupees", "exchange_rate": 1}, {}, "tenant.currency", "ISO 4217"),
        ({"currency": "INR"}, {}, "tenant.exchange_rate", "required with currency INR"),
        ({"currency": "INR", "exchange_rate": 0}, {}, "tenant.exchange_rate", "more than 0"),
        ({}, {"summary": "Refund {amount"}, "tools[0].summary", "unmatched"),
        ({}, {"summary": "Refund {a b}"}, "tools[0].summary", "placeholder"),
        ({}, {"money": {"amount": 5}}, "tools[0].money.amount", "currency code"),
    ],
)
def test_bad_money_settings_are_refused_at_their_path(tenant_fields, tool_fields, path, message):
    data = config()
    data["tenant"].update(tenant_fields)
    data["tools"][0].update(tool_fields)
    errors = dict(rejected(data))
    assert path in errors and message in errors[path], errors


def test_usage_names_its_currency_and_says_when_a_day_is_over_its_limit(tenant):
    Tenant.objects.filter(pk=tenant.pk).update(currency="INR", exchange_rate=Decimal("83.25"))
    tenant.refresh_from_db()
    user = factories.make_user(tenant, "uma")
    reservation = budgets.reserve(tenant=tenant, amount_micros=tenant.daily_budget_micros, purpose="model")
    # A call that cost more than it reserved: the day goes over.
    budgets.settle(reservation.pk, actual_micros=tenant.daily_budget_micros + 1_000_000)
    client = APIClient()
    client.force_authenticate(user)

    body = client.get("/v1/usage?days=1").json()

    assert body["currency"] == "USD" and body["currency_micros_per_unit"] == 1_000_000
    assert body["display_currency"] == "INR" and body["exchange_rate"] == "83.250000"
    (today,) = body["days"]
    assert today["remaining_micros"] < 0 and today["over_limit"] is True
