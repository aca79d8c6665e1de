"""The secret canary, extended to delegated authority: the platform's signing key, the assertions
it presents, the IdP's client secret and the tokens the IdP issued never appear in the model's
requests, step records, events, logs, API responses, admin pages or a database dump in clear
(issue 25 section 4)."""

from __future__ import annotations

import base64
import json
import logging

import pytest
from cryptography.hazmat.primitives import serialization
from django.conf import settings
from django.db import connection
from rest_framework.test import APIClient

from authority import keys
from authority.models import Delegation, ExchangedToken, IdentityProvider
from llm.models import ModelEndpoint
from runs.models import RunEvent, RunStatus, Step
from runs.services import start_run
from tenants.crypto import REDACTED
from tenants.models import User
from tests import factories
from tests.authority.conftest import RecordingToolServer, http_tool, secret
from tests.conftest import drive
from tests.gateway.conftest import MODEL_KEY
from tests.gateway.test_servers import _admin_pages
from tests.idp import TokenServer

pytestmark = pytest.mark.django_db(transaction=True)


def _database_dump() -> str:
    """Every row of every table as JSON text: what a dump of the database would hold."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        tables = [row[0] for row in cursor.fetchall()]
        rows = []
        for table in tables:
            cursor.execute(f'SELECT row_to_json(t)::text FROM "{table}" t')
            rows.extend(row[0] for row in cursor.fetchall())
    return "\n".join(rows)


def test_it_keeps_keys_assertions_and_exchanged_tokens_out_of_everything_stored_or_shown(
    tenant,
    asha,
    claude,
    live_server,
    caplog,
):
    caplog.set_level(logging.DEBUG)
    idp = TokenServer(
        platform_jwks_url=f"{live_server.url}/.well-known/jwks.json",
        platform_issuer=settings.ASSERTION_ISSUER,
    ).start()
    # A careless provider that echoes every credential it was sent, in its answer and its errors.
    leaky = RecordingToolServer(idp_keys=idp.public_keys(), echo=("Agent-Assertion", "Authorization")).start()
    try:
        IdentityProvider.objects.create(
            tenant=tenant,
            token_url=idp.token_url,
            client_id=secret(tenant, "idp-client-id", idp.client.client_id),
            client_secret=secret(tenant, "idp-client-secret", idp.client.secret),
        )
        tool = http_tool(tenant, leaky.url, server_name="payments")
        Delegation.objects.create(
            server=tool.server, mode=Delegation.Mode.TOKEN_EXCHANGE, audience="https://payments.example"
        )
        factories.grant(tool, use=[asha])
        factories.make_agent(
            tenant, endpoint=ModelEndpoint.objects.get(tenant=tenant, name="claude"), tools=[tool]
        )
        claude.queue(
            {"tool_calls": [{"name": tool.name, "arguments": {"q": "who am I"}}]},
            {"tool_calls": [{"name": tool.name, "arguments": {"q": "again"}}]},
            {"text": "done"},
        )
        run, _ = start_run(user=asha, agent="agent", input={})
        run = drive(run.pk)
        assert run.status == RunStatus.SUCCEEDED, run.error

        steps = list(Step.objects.filter(run=run, kind="tool").order_by("seq"))
        assert [s.result["structured"]["acting_for"] for s in steps] == ["asha", "asha"]  # the token worked
        assert steps[0].result["structured"]["echo_Agent-Assertion"] == REDACTED
        assert steps[0].result["structured"]["echo_Authorization"] == f"Bearer {REDACTED}"
        assertions = [r["headers"]["Agent-Assertion"] for r in leaky.requests]
        tokens = {r["headers"]["Authorization"].removeprefix("Bearer ") for r in leaky.requests}
        kid, private = keys.signing_key()
        pem = private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ).decode()
        raw = private.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        canaries = {
            "signing key (PEM)": pem.splitlines()[1],
            "signing key (JWK d)": base64.urlsafe_b64encode(raw).rstrip(b"=").decode(),
            "IdP client secret": idp.client.secret,
            "model key": MODEL_KEY,
            **{f"assertion {i}": a for i, a in enumerate(assertions)},
            **{f"exchanged token {i}": t for i, t in enumerate(sorted(tokens))},
        }

        places = {"model requests on the wire": json.dumps(claude.requests)}
        for step in Step.objects.filter(run=run):
            places[f"step {step.seq}"] = json.dumps(
                [step.tool_name, step.arguments, step.request, step.result, step.observation, step.error]
            )
        places["events"] = json.dumps([[e.message, e.data] for e in RunEvent.objects.filter(run=run)])
        places["run"] = json.dumps([run.final_output, run.error, run.input])
        places["logs"] = caplog.text + "".join(str(r.args) for r in caplog.records)
        api = APIClient()
        api.force_authenticate(asha)
        for path in (f"/v1/runs/{run.pk}", f"/v1/runs/{run.pk}/steps", f"/v1/runs/{run.pk}/events"):
            response = api.get(path)
            assert response.status_code == 200
            places[path] = response.content.decode()
        places["/.well-known/jwks.json"] = api.get("/.well-known/jwks.json").content.decode()
        operator = User.objects.create_superuser(username="ops", password="pw")
        web = APIClient()
        web.force_login(operator)
        admin_pages = _admin_pages(web)
        assert any("/authority/exchangedtoken/" in url for url in admin_pages)
        assert any("/authority/signingkey/" in url for url in admin_pages)
        places.update(admin_pages)
        places["database dump"] = _database_dump()
        assert ExchangedToken.objects.get().ciphertext in places["database dump"]  # the dump is real

        leaks = [
            f"{what} in {where}"
            for where, text in places.items()
            for what, v in canaries.items()
            if v in text
        ]
        assert not leaks, "leaked: " + "; ".join(leaks)
        # What may be shown is: who was presented, to whom, under which jti.
        assert "asha" in places["events"] and steps[0].idempotency_key in places["events"]
        assert kid in places["/.well-known/jwks.json"]
    finally:
        leaky.stop()
        idp.stop()
