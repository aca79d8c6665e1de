"""API tokens: stored hashed, expiring, refreshable, revocable, ended by a password change or
deactivation, accepted as Bearer or Token; sign-in and run starts are rate limited."""

from __future__ import annotations

import datetime as dt
import hashlib

import pytest
from django.core.management import call_command
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from tenants.models import ApiToken
from tests import factories

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _fast_passwords(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def sign_in(username="asha", password="pw"):
    return APIClient().post("/v1/auth/token", {"username": username, "password": password}, format="json")


def client(token: str, scheme: str = "Bearer") -> APIClient:
    authed = APIClient()
    authed.credentials(HTTP_AUTHORIZATION=f"{scheme} {token}")
    return authed


def test_only_a_hash_of_the_token_is_stored(asha):
    answer = sign_in()
    assert answer.status_code == 200
    token = answer.json()["token"]
    assert answer.json()["token_type"] == "Bearer" and len(token) >= 40
    with connection.cursor() as cursor:
        cursor.execute("SELECT digest FROM tenants_apitoken")
        stored = [row[0] for row in cursor.fetchall()]
        cursor.execute("SELECT count(*) FROM authtoken_token")
        assert cursor.fetchone()[0] == 0
    assert stored == [hashlib.sha256(token.encode()).hexdigest()]
    assert token not in str(stored)


def test_bearer_and_token_schemes_both_authenticate(asha):
    token = sign_in().json()["token"]
    assert client(token, "Bearer").get("/v1/runs").status_code == 200
    assert client(token, "Token").get("/v1/runs").status_code == 200
    assert client(token + "x").get("/v1/runs").status_code == 401


def test_a_token_expires(asha, settings):
    settings.API_TOKEN_TTL_SECONDS = 3600
    answer = sign_in().json()
    expires_at = dt.datetime.fromisoformat(answer["expires_at"].replace("Z", "+00:00"))
    assert abs((expires_at - timezone.now()).total_seconds() - 3600) < 60
    assert client(answer["token"]).get("/v1/runs").status_code == 200
    ApiToken.objects.update(expires_at=timezone.now() - dt.timedelta(seconds=1))
    expired = client(answer["token"]).get("/v1/runs")
    assert expired.status_code == 401 and "expired" in expired.json()["error"]["message"]


def test_refresh_swaps_the_token_and_revokes_the_old_one(asha):
    old = sign_in().json()["token"]
    refreshed = client(old).post("/v1/auth/token/refresh")
    assert refreshed.status_code == 200
    new = refreshed.json()["token"]
    assert new != old
    assert client(old).get("/v1/runs").status_code == 401
    assert client(new).get("/v1/runs").status_code == 200
    assert client(old).post("/v1/auth/token/refresh").status_code == 401
    assert ApiToken.objects.count() == 1


def test_refresh_ends_at_the_maximum_age_of_the_sign_in(asha, settings):
    token = sign_in().json()["token"]
    settings.API_TOKEN_MAX_AGE_SECONDS = 3600
    ApiToken.objects.update(signed_in_at=timezone.now() - dt.timedelta(hours=2))
    answer = client(token).post("/v1/auth/token/refresh")
    assert answer.status_code == 401 and "too old" in answer.json()["error"]["message"]


def test_delete_revokes_the_callers_token_only(asha):
    first, second = sign_in().json()["token"], sign_in().json()["token"]
    assert client(first).delete("/v1/auth/token").status_code == 204
    assert client(first).get("/v1/runs").status_code == 401
    assert client(second).get("/v1/runs").status_code == 200
    assert APIClient().delete("/v1/auth/token").status_code == 401


def test_signing_in_works_with_a_stale_token_in_the_header(asha):
    stale = client("ap_revoked")
    assert (
        stale.post("/v1/auth/token", {"username": "asha", "password": "pw"}, format="json").status_code == 200
    )


@pytest.mark.parametrize("how", ["set_password", "changepassword_command"])
def test_a_password_change_anywhere_revokes_every_token(asha, how, monkeypatch):
    tokens = [sign_in().json()["token"], sign_in().json()["token"]]
    if how == "set_password":
        asha.set_password("new-pw")
        asha.save()
    else:
        monkeypatch.setattr("getpass.getpass", lambda prompt="": "A-new-long-passphrase-42")
        call_command("changepassword", "asha")
    for token in tokens:
        assert client(token).get("/v1/runs").status_code == 401
    assert not ApiToken.objects.filter(user=asha).exists()


def test_deactivation_revokes_every_token_even_after_reactivation(tenant, asha, ravi):
    token = sign_in().json()["token"]
    asha.is_active = False
    asha.save()
    assert client(token).get("/v1/runs").status_code == 401
    asha.is_active = True
    asha.save()
    assert client(token).get("/v1/runs").status_code == 401


def test_deactivation_in_the_admin_revokes_tokens_at_once(tenant, asha):
    operator = factories.make_user(tenant, "op", staff=True)
    operator.is_superuser = True
    operator.save()
    token = sign_in().json()["token"]
    admin = APIClient()
    admin.force_login(operator)
    page = admin.get(f"/admin/tenants/user/{asha.pk}/change/")
    assert page.status_code == 200
    form = {
        "username": "asha",
        "tenant": tenant.pk,
        "email": "",
        "first_name": "",
        "last_name": "",
        "is_staff": "",
        "is_active": "",
        "date_joined_0": "2026-01-01",
        "date_joined_1": "00:00:00",
        "initial-date_joined_0": "2026-01-01",
        "initial-date_joined_1": "00:00:00",
    }
    answer = admin.post(f"/admin/tenants/user/{asha.pk}/change/", form)
    assert answer.status_code == 302, answer.content[:2000]
    assert not ApiToken.objects.filter(user=asha).exists()
    asha.refresh_from_db()
    asha.is_active = True
    asha.save()
    assert client(token).get("/v1/runs").status_code == 401


def test_sign_in_is_rate_limited_per_username_with_retry_after(asha, settings):
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_RATES": {
            **settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"],
            "token_username": "5/min",
            "token_address": "100/min",
        },
    }
    answers = [sign_in(password="wrong").status_code for _ in range(5)]
    assert answers == [401] * 5
    throttled = sign_in()  # the right password, too late
    assert throttled.status_code == 429 and int(throttled["Retry-After"]) > 0
    assert throttled.json()["error"]["code"] == "throttled"
    assert not ApiToken.objects.exists()
    assert sign_in(username="ravi").status_code in (200, 401)  # another username is not blocked


def test_sign_in_is_rate_limited_per_client_address(tenant, settings):
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_RATES": {
            **settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"],
            "token_username": "100/min",
            "token_address": "3/min",
        },
    }
    assert [sign_in(username=f"user{i}").status_code for i in range(3)] == [401] * 3
    other_address = APIClient(REMOTE_ADDR="10.0.0.9")
    assert sign_in(username="user9").status_code == 429
    assert (
        other_address.post(
            "/v1/auth/token", {"username": "user9", "password": "x"}, format="json"
        ).status_code
        == 401
    )


def test_run_starts_are_rate_limited_per_user(tenant, asha, ravi, builtins, settings):
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_RATES": {**settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"], "run_start": "2/min"},
    }
    factories.make_agent(tenant, tools=[builtins["echo"]], turns=[{"text": "hi"}])
    asha_api, ravi_api = APIClient(), APIClient()
    asha_api.force_authenticate(asha)
    ravi_api.force_authenticate(ravi)
    body = {"agent": "agent", "input": {}}
    assert [asha_api.post("/v1/runs", body, format="json").status_code for _ in range(2)] == [201, 201]
    third = asha_api.post("/v1/runs", body, format="json")
    assert third.status_code == 429 and int(third["Retry-After"]) > 0
    assert asha_api.get("/v1/runs").status_code == 200  # reads are not limited
    assert ravi_api.post("/v1/runs", body, format="json").status_code == 201
