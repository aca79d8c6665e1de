"""tenants.secrets on the real database: a cached step reads no secrets, and a write by anyone counts at once."""

from __future__ import annotations

import psycopg
import pytest
from django.conf import settings
from django.db import connection
from django.test.utils import CaptureQueriesContext

from tenants import secrets
from tenants.crypto import encrypt
from tenants.models import Secret, Tenant

pytestmark = pytest.mark.django_db(transaction=True)


def elsewhere(sql: str, params) -> None:
    """Write through a connection of its own, as another process (the admin, an apply) would."""
    params_ = connection.get_connection_params()
    for key in ("cursor_factory", "context", "prepare_threshold"):
        params_.pop(key, None)
    with psycopg.connect(**params_, autocommit=True) as conn:
        conn.execute(sql, params)


def test_it_reads_only_the_generation_while_no_secret_changed(tenant):
    Secret(
        tenant=tenant, name="bank", ciphertext=encrypt("s3cret-bank", settings.SECRET_ENCRYPTION_KEYS)
    ).save()
    assert secrets.known_secrets(tenant.pk) == ["s3cret-bank"]
    with CaptureQueriesContext(connection) as queries:
        assert secrets.redact_text(tenant.pk, "key s3cret-bank") != "key s3cret-bank"
    assert len(queries) == 1
    assert Secret._meta.db_table not in queries[0]["sql"]


def test_a_secret_written_by_another_connection_is_redacted_at_once(tenant):
    other = Tenant.objects.create(slug="other", name="Other")
    assert secrets.known_secrets(tenant.pk) == []
    assert secrets.known_secrets(other.pk) == []
    table = Secret._meta.db_table
    elsewhere(
        f'INSERT INTO "{table}" (tenant_id, name, ciphertext, updated_at) VALUES (%s, %s, %s, now())',
        [tenant.pk, "bank", encrypt("first-value", settings.SECRET_ENCRYPTION_KEYS)],
    )
    assert secrets.known_secrets(tenant.pk) == ["first-value"]
    assert secrets.known_secrets(other.pk) == []  # another tenant's cache did not move
    elsewhere(
        f'UPDATE "{table}" SET ciphertext = %s WHERE tenant_id = %s',
        [encrypt("second-value", settings.SECRET_ENCRYPTION_KEYS), tenant.pk],
    )
    assert secrets.known_secrets(tenant.pk) == ["second-value"]
    elsewhere(f'UPDATE "{table}" SET tenant_id = %s WHERE tenant_id = %s', [other.pk, tenant.pk])
    assert secrets.known_secrets(tenant.pk) == []  # a move counts for both tenants
    assert secrets.known_secrets(other.pk) == ["second-value"]
    elsewhere(f'DELETE FROM "{table}" WHERE tenant_id = %s', [other.pk])
    assert secrets.known_secrets(other.pk) == []
