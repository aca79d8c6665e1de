"""Every registered admin page renders for an operator and for a tenant admin (no 500s, no leaks)."""

from __future__ import annotations

from django.contrib.auth.models import Permission

from tenants.admin_site import scope, site
from tenants.models import Secret
from tests import factories
from tests.admin.helpers import park_on_approval


def pages(user):
    """(url, expected statuses) for the changelist, add and first change page of every model."""
    for model, _model_admin in site._registry.items():
        opts = model._meta
        base = f"/admin/{opts.app_label}/{opts.model_name}/"
        yield base, {200, 403}
        yield f"{base}add/", {200, 403}
        first = scope(model._default_manager.all(), user).order_by("pk").first()
        if first is not None:
            # The inbox narrows the tenant's approvals further, to those the user may approve.
            hidden = {404} if opts.label_lower == "approvals.approval" else set()
            yield f"{base}{first.pk}/change/", {200, 403} | hidden
            yield f"{base}{first.pk}/history/", {200, 403} | hidden


def seed(acme):
    park_on_approval(acme.asha, "refunder")
    secret = Secret(tenant=acme.tenant, name="token")
    secret.set_value("abcd-secret-value")
    secret.save()


def test_every_page_renders_for_an_operator(client, operator, acme, globex):
    seed(acme)
    client.force_login(operator)

    assert client.get("/admin/").status_code == 200
    rendered = 0
    for url, expected in pages(operator):
        response = client.get(url)
        assert response.status_code in expected, url
        assert b"abcd-secret-value" not in response.content
        rendered += response.status_code == 200
    assert rendered >= 40


def test_every_page_renders_for_a_tenant_admin_and_shows_only_the_tenant(client, acme, globex):
    seed(acme)
    ada = factories.make_user(acme.tenant, "ada", staff=True)
    ada.user_permissions.add(*Permission.objects.all())
    client.force_login(ada)

    assert client.get("/admin/").status_code == 200
    rendered = 0
    for url, expected in pages(ada):
        response = client.get(url)
        assert response.status_code in expected, url
        assert b"globex" not in response.content, url
        assert b"abcd-secret-value" not in response.content
        rendered += response.status_code == 200
    assert rendered >= 30
