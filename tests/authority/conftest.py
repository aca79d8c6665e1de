"""Fixtures for delegated authority: the platform's key set served live, a tool server that records
what each call presented, the tenant's identity provider (tests/idp.py)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jwt
import pytest
from django.conf import settings

from tenants.models import Secret
from tests.gateway.conftest import claude  # noqa: F401  (the recording model server, as a fixture here)
from tools.models import Tool, ToolServer


class RecordingToolServer:
    """An HTTP tool server that keeps each request's headers and body; `fail_first` answers 500 to
    that many calls first (after "applying" them, as a flaky provider does). With `idp_keys` it
    checks the bearer token the IdP issued and answers whom it acts for."""

    def __init__(self, *, fail_first: int = 0, idp_keys=None, echo: tuple[str, ...] = ()):
        self.requests: list[dict] = []
        self.fail_first = fail_first
        self.idp_keys = idp_keys
        self.echo = echo
        self._http: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._http is not None
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    def start(self) -> RecordingToolServer:
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                recorder.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                status, answer = 200, {"ok": True, "seen": len(recorder.requests)}
                if recorder.idp_keys is not None:
                    status, answer = recorder._check_token(self.headers.get("Authorization", ""))
                for name in recorder.echo:  # a careless provider that echoes what it was sent
                    answer[f"echo_{name}"] = self.headers.get(name, "")
                if len(recorder.requests) <= recorder.fail_first:
                    status, answer = 500, {"error": "flaky"}
                payload = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        return self

    def _check_token(self, authorization: str) -> tuple[int, dict]:
        from joserfc import jwt as jose_jwt
        from joserfc.errors import JoseError

        token = authorization.removeprefix("Bearer ")
        try:
            claims = jose_jwt.decode(token, self.idp_keys).claims
        except (JoseError, ValueError) as exc:
            return 401, {"error": f"bad token: {exc}"}
        return 200, {"acting_for": claims["sub"], "scope": claims.get("scope", ""), "aud": claims["aud"]}

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()


@pytest.fixture
def recorder():
    server = RecordingToolServer().start()
    yield server
    server.stop()


@pytest.fixture
def platform_jwks(live_server) -> str:
    return f"{live_server.url}/.well-known/jwks.json"


def http_tool(tenant, url: str, *, server_name: str = "hr", remote: str = "lookup", **fields) -> Tool:
    server = ToolServer.objects.create(tenant=tenant, name=server_name, kind=ToolServer.Kind.HTTP, url=url)
    defaults = dict(
        input_schema={"type": "object"}, enabled=True, effect_class="read_only", timeout_seconds=5
    )
    defaults.update(fields)
    return Tool.objects.create(
        tenant=tenant, server=server, name=f"{server_name}__{remote}", remote_name=remote, **defaults
    )


def verify(token: str, jwks_url: str, audience: str) -> dict:
    key = jwt.PyJWKClient(jwks_url).get_signing_key_from_jwt(token)
    return jwt.decode(
        token, key.key, algorithms=["EdDSA"], audience=audience, issuer=settings.ASSERTION_ISSUER
    )


def secret(tenant, name: str, value: str) -> Secret:
    row = Secret(tenant=tenant, name=name)
    row.set_value(value)
    row.save()
    return row
