"""AGENTPLATFORM_ENV=production: HTTPS-only settings, and no start on a weak key or DEBUG (issue #12, item 6).

Settings are read once per process, so each case runs manage.py in a subprocess with its own environment.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import pytest
from cryptography.fernet import Fernet

from tests.servers import ROOT

DATABASE_URL = "postgres://root@127.0.0.1:5432/postgres"
SHOW = (
    "from django.conf import settings as s; import json; print(json.dumps({k: getattr(s, k, None) for k in "
    "['DEBUG', 'SECURE_HSTS_SECONDS', 'SECURE_HSTS_INCLUDE_SUBDOMAINS', 'SECURE_SSL_REDIRECT', "
    "'SESSION_COOKIE_SECURE', 'CSRF_COOKIE_SECURE', 'SECURE_PROXY_SSL_HEADER']}))"
)


def manage(*args: str, **env: str | None) -> subprocess.CompletedProcess:
    """manage.py in production mode with a valid environment, changed by `env` (None: unset)."""
    unset = ("DEBUG", "SECRET_KEY", "SECRET_ENCRYPTION_KEYS", "METRICS_TOKEN", "METRICS_ALLOW_FROM")
    base = {k: v for k, v in os.environ.items() if k not in unset}
    full: dict[str, str | None] = {
        **base,
        "AGENTPLATFORM_ENV": "production",
        "DATABASE_URL": DATABASE_URL,
        "CONTENT_KEYS_DATABASE_URL": f"{DATABASE_URL}_keys",
        "SECRET_KEY": secrets.token_urlsafe(50),
        "SECRET_ENCRYPTION_KEYS": Fernet.generate_key().decode(),
        "ASSERTION_ISSUER": "https://agents.bank.example",
        "PUBLIC_BASE_URL": "https://agents.bank.example/",
        **env,
    }

    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env={k: v for k, v in full.items() if v is not None},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_deploy_check_finds_nothing_to_warn_about():
    done = manage("check", "--deploy", "--fail-level", "WARNING")

    assert done.returncode == 0, done.stdout + done.stderr
    assert "System check identified no issues" in done.stdout


def test_it_turns_on_hsts_https_redirect_and_secure_cookies():
    done = manage("shell", "-c", SHOW, SECURE_PROXY_SSL_HEADER="X-Forwarded-Proto")

    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "DEBUG": False,
        "SECURE_HSTS_SECONDS": 31_536_000,
        "SECURE_HSTS_INCLUDE_SUBDOMAINS": True,
        "SECURE_SSL_REDIRECT": True,
        "SESSION_COOKIE_SECURE": True,
        "CSRF_COOKIE_SECURE": True,
        "SECURE_PROXY_SSL_HEADER": ["HTTP_X_FORWARDED_PROTO", "https"],
    }


@pytest.mark.parametrize(
    ("key", "complaint"),
    [
        ("x" * 64, "not random enough"),
        ("abcd" * 20, "not random enough"),
        ("django-insecure-" + secrets.token_urlsafe(50), "django-insecure"),
        (secrets.token_urlsafe(20), "at least 50 characters"),
    ],
    ids=["repeated", "pattern", "django-insecure", "short"],  # the same ids in every xdist worker
)
def test_it_refuses_to_start_with_a_weak_secret_key(key, complaint):
    done = manage("check", SECRET_KEY=key)

    assert done.returncode != 0
    assert "ConfigError" in done.stderr and complaint in done.stderr
    assert key not in done.stderr  # the key itself is never printed


@pytest.mark.parametrize(
    "keys", ["not-a-fernet-key", f"{Fernet.generate_key().decode()},short"], ids=["not-a-key", "one-short"]
)
def test_it_refuses_to_start_with_an_invalid_encryption_key(keys):
    done = manage("check", SECRET_ENCRYPTION_KEYS=keys)

    assert done.returncode != 0
    assert "ConfigError" in done.stderr and "is not a valid Fernet key" in done.stderr
    assert "not-a-fernet-key" not in done.stderr


def test_it_refuses_debug_in_production():
    done = manage("check", DEBUG="true")

    assert done.returncode != 0
    assert "DEBUG must not be on in production" in done.stderr


@pytest.mark.parametrize(
    "value, complaint",
    [
        (None, "CONTENT_KEYS_DATABASE_URL must be set in production"),
        (DATABASE_URL, "must not be the platform's own database"),
    ],
)
def test_it_refuses_content_keys_beside_the_content(value, complaint):
    # Kept in the platform's database (or derived beside it), the keys that seal run content would
    # be in the same dumps and backups as that content, and erasing a key would not reach them.
    done = manage("check", CONTENT_KEYS_DATABASE_URL=value)

    assert done.returncode != 0
    assert complaint in done.stderr


def test_a_strong_key_and_valid_keys_start():
    done = manage("check")

    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", ["ASSERTION_ISSUER", "PUBLIC_BASE_URL"])
def test_it_refuses_to_start_without_a_url_it_publishes(name):
    # Dev's default (http://127.0.0.1:8000) would be the issuer providers fetch keys from and the
    # OAuth callback registered with every authorization server.
    done = manage("check", **{name: None})

    assert done.returncode != 0
    assert f"{name} must be set in production" in done.stderr


@pytest.mark.parametrize(
    ("value", "complaint"),
    [
        ("http://agents.bank.example", "must use https in production"),
        ("agents.bank.example", "absolute http(s) URL"),
        ("https://agents.bank.example/?x=1", "no credentials, query or fragment"),
        ("https://user:pw@agents.bank.example", "no credentials, query or fragment"),
    ],
    ids=["plain-http", "no-scheme", "query", "credentials"],
)
@pytest.mark.parametrize("name", ["ASSERTION_ISSUER", "PUBLIC_BASE_URL"])
def test_it_refuses_a_published_url_that_is_not_a_public_https_base(name, value, complaint):
    done = manage("check", **{name: value})

    assert done.returncode != 0
    assert "ConfigError" in done.stderr and complaint in done.stderr
    assert "pw@" not in done.stderr


def test_the_published_urls_are_kept_without_a_trailing_slash():
    show = "from django.conf import settings as s; print(s.ASSERTION_ISSUER, s.PUBLIC_BASE_URL)"
    done = manage("shell", "-c", show, ASSERTION_ISSUER="http://localhost:8000/")

    # http is taken for a loopback host only: production mode tried on one machine (README).
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-2:] == ["http://localhost:8000", "https://agents.bank.example"]


def test_it_refuses_a_short_metrics_token():
    done = manage("check", METRICS_TOKEN="metrics-token-1")

    assert done.returncode != 0
    assert "METRICS_TOKEN must be at least 32 characters" in done.stderr
    assert "metrics-token-1" not in done.stderr


def test_it_refuses_a_signing_key_lead_shorter_than_twice_the_key_set_cache_bound():
    done = manage("check", SIGNING_KEY_LEAD_SECONDS="12")

    assert done.returncode != 0
    assert "SIGNING_KEY_LEAD_SECONDS must be at least twice JWKS_CACHE_SECONDS (600)" in done.stderr
