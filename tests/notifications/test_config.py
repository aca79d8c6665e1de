"""Webhooks through `apply` (and the admin): held to the tenant's egress hosts, secret encrypted."""

from __future__ import annotations

import pytest

from configuration.apply import ConfigError, apply_config
from notifications.admin import WebhookForm
from notifications.models import Webhook
from tests.notifications.conftest import SECRET

pytestmark = pytest.mark.django_db

SLUG = "hooks-test"


def config(**webhook) -> dict:
    hook = {
        "name": "supervisors",
        "url": "https://hooks.bank.example/agentplatform",
        "signing_secret": SECRET,
        "events": ["approval_requested", "run_needs_attention"],
        **webhook,
    }
    return {"tenant": {"slug": SLUG, "egress_hosts": ["*.bank.example"]}, "webhooks": [hook]}


def errors_of(data: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        apply_config(data)
    return dict(caught.value.errors)


def test_apply_rejects_a_webhook_outside_the_egress_hosts_at_its_url():
    errors = errors_of(config(url="http://10.0.0.7/steal"))

    assert errors == {"webhooks[0].url": "host is not in tenant.egress_hosts (10.0.0.7)"}
    assert not Webhook.objects.exists()


def test_apply_creates_a_webhook_with_its_secret_encrypted_and_reapplies_unchanged():
    report = apply_config(config())

    hook = Webhook.objects.get(tenant__slug=SLUG, name="supervisors")
    assert report.outcomes["webhooks"] == {"supervisors": "created"}
    assert hook.events == ["approval_requested", "run_needs_attention"] and hook.enabled
    assert SECRET not in hook.signing_ciphertext and hook.signing_secret() == SECRET
    assert SECRET not in report.render()
    again = apply_config(config())
    assert again.outcomes["webhooks"] == {"supervisors": "unchanged"}
    assert Webhook.objects.get(pk=hook.pk).signing_ciphertext == hook.signing_ciphertext


def test_apply_restores_a_url_changed_outside_the_file_and_reports_the_drift():
    apply_config(config())
    Webhook.objects.update(url="https://other.bank.example/x")

    report = apply_config(config(signing_secret="a-new-secret-0123456789"))

    hook = Webhook.objects.get()
    assert hook.url == "https://hooks.bank.example/agentplatform"
    assert hook.signing_secret() == "a-new-secret-0123456789"
    assert any("webhooks supervisors: url, signing_secret" in line for line in report.drift)


def test_apply_refuses_a_narrower_egress_list_that_a_stored_webhook_would_escape():
    apply_config(config())
    data = config()
    data["tenant"]["egress_hosts"] = ["tools.example"]
    data["webhooks"] = []

    errors = errors_of(data)

    assert "webhook 'supervisors'" in errors["tenant.egress_hosts"]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("events", ["approval_denied"], "webhooks[0].events[0]"),
        ("events", [], "webhooks[0].events"),
        ("signing_secret", "short", "webhooks[0].signing_secret"),
        ("url", "ftp://hooks.bank.example/x", "webhooks[0].url"),
    ],
)
def test_apply_reports_bad_webhook_fields_at_their_path(field, value, message):
    assert message in errors_of(config(**{field: value}))


def test_apply_takes_the_secret_from_the_environment(monkeypatch):
    monkeypatch.setenv("HOOK_SECRET_FOR_TEST", "from-the-environment-123")
    data = config()
    del data["webhooks"][0]["signing_secret"]
    data["webhooks"][0]["signing_secret_env"] = "HOOK_SECRET_FOR_TEST"

    apply_config(data)

    assert Webhook.objects.get().signing_secret() == "from-the-environment-123"


def test_the_admin_form_refuses_a_url_outside_the_egress_hosts():
    apply_config(config())
    tenant = Webhook.objects.get().tenant
    form = WebhookForm(
        data={
            "tenant": tenant.pk,
            "name": "second",
            "url": "http://10.0.0.7/steal",
            "events": ["approval_requested"],
            "enabled": "on",
            "signing_secret": SECRET,
        }
    )

    assert not form.is_valid()
    assert form.errors["url"] == ["host is not in tenant.egress_hosts"]
