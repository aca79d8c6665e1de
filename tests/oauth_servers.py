"""A real OAuth authorization server and an MCP server that requires its tokens, for the tests.

    python -m tests.oauth_servers [--token-seconds N]
    -> OAUTH_SERVERS_READY <authorization server URL> <MCP server URL>

The authorization server is the `mcp` SDK's own (mcp.server.auth.routes: metadata, authorize with
PKCE, token, dynamic client registration, revocation) over an in-memory provider with one sign-in
page; the MCP server is the SDK's streamable HTTP server with its bearer-token middleware, which
answers 401 with protected resource metadata (RFC 9728) and only accepts tokens issued for its own
resource (RFC 8707). Both run here, on two ports (two origins), as a bank's would.

Test controls on the authorization server: GET /control/calls (every tool call the MCP server ran,
with the token's subject), POST /control/revoke?user=U (the server forgets U's tokens: a refresh is
refused), GET /control/tokens (counts of live tokens by kind).

The platform as a client of its own (client credentials grant, RFC 6749 section 4.4): POST
/oauth/client-token takes `grant_type=client_credentials` from the machine client
`platform-agents` (secret MACHINE_SECRET; HTTP Basic or in the form), `scope` within
statements:read and `resource` (or `audience`: the MCP server's URL), and issues an access token
whose subject is the client; GET /control/client-tokens counts the token requests (by outcome)
and lists the tokens issued.
"""

from __future__ import annotations

import argparse
import json
import secrets
import socket
import threading
import time
from typing import Any

import anyio
import mcp_types as types
import uvicorn
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.provider import (
    AccessToken,
    AuthorizationCode,
    AuthorizationParams,
    ProviderTokenVerifier,
    RefreshToken,
    construct_redirect_uri,
)
from mcp.server.auth.routes import create_auth_routes
from mcp.server.auth.settings import AuthSettings, ClientRegistrationOptions, RevocationOptions
from mcp.server.lowlevel import Server
from mcp.shared.auth import OAuthClientInformationFull, OAuthToken
from pydantic import AnyHttpUrl
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

READY = "OAUTH_SERVERS_READY"
USERS = {"asha": "asha-password", "ravi": "ravi-password"}
SCOPE = "statements:read"
MACHINE_CLIENT, MACHINE_SECRET = "platform-agents", "machine-secret-9f3b1c"


class Bank:
    """The provider's state: clients, sign-ins in progress, codes, tokens; and the calls served."""

    def __init__(self, issuer: str, token_seconds: int):
        self.issuer = issuer
        self.token_seconds = token_seconds
        self.clients: dict[str, OAuthClientInformationFull] = {}
        self.sign_ins: dict[str, tuple[str, AuthorizationParams]] = {}
        self.codes: dict[str, AuthorizationCode] = {}
        self.access: dict[str, AccessToken] = {}
        self.refresh: dict[str, RefreshToken] = {}
        self.calls: list[dict] = []
        self.client_token_requests: dict[str, int] = {}
        self.client_tokens: list[str] = []  # every token issued to the machine client, for canaries

    # --- OAuthAuthorizationServerProvider ---------------------------------------------------

    async def get_client(self, client_id: str) -> OAuthClientInformationFull | None:
        return self.clients.get(client_id)

    async def register_client(self, client_info: OAuthClientInformationFull) -> None:
        assert client_info.client_id is not None
        self.clients[client_info.client_id] = client_info

    async def authorize(self, client: OAuthClientInformationFull, params: AuthorizationParams) -> str:
        key = secrets.token_urlsafe(16)
        assert client.client_id is not None
        self.sign_ins[key] = (client.client_id, params)
        return f"{self.issuer}/login?request={key}"

    async def load_authorization_code(self, client: OAuthClientInformationFull, authorization_code: str):
        code = self.codes.get(authorization_code)
        return code if code is not None and code.client_id == client.client_id else None

    async def exchange_authorization_code(self, client: OAuthClientInformationFull, authorization_code):
        self.codes.pop(authorization_code.code, None)
        return self._issue(
            client.client_id or "",
            authorization_code.scopes,
            authorization_code.resource,
            authorization_code.subject,
        )

    async def load_refresh_token(self, client: OAuthClientInformationFull, refresh_token: str):
        token = self.refresh.get(refresh_token)
        return token if token is not None and token.client_id == client.client_id else None

    async def exchange_refresh_token(self, client: OAuthClientInformationFull, refresh_token, scopes):
        self.refresh.pop(refresh_token.token, None)  # rotated: each refresh token is used once
        return self._issue(
            client.client_id or "",
            scopes or refresh_token.scopes,
            refresh_token.resource,
            refresh_token.subject,
        )

    async def load_access_token(self, token: str) -> AccessToken | None:
        found = self.access.get(token)
        if found is None or (found.expires_at is not None and found.expires_at < time.time()):
            return None
        return found

    async def revoke_token(self, token) -> None:
        self.access.pop(token.token, None)
        self.refresh.pop(token.token, None)

    def _issue(
        self, client_id: str, scopes: list[str], resource: str | None, subject: str | None
    ) -> OAuthToken:
        access, refresh = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
        expires = int(time.time()) + self.token_seconds
        self.access[access] = AccessToken(
            token=access,
            client_id=client_id,
            scopes=scopes,
            expires_at=expires,
            resource=resource,
            subject=subject,
        )
        self.refresh[refresh] = RefreshToken(
            token=refresh, client_id=client_id, scopes=scopes, resource=resource, subject=subject
        )
        return OAuthToken(
            access_token=access,
            token_type="Bearer",
            expires_in=self.token_seconds,
            refresh_token=refresh,
            scope=" ".join(scopes),
        )

    # --- the sign-in page and the test controls ---------------------------------------------

    async def login(self, request: Request) -> Response:
        if request.method == "GET":
            key = request.query_params.get("request", "")
            if key not in self.sign_ins:
                return HTMLResponse("unknown sign-in", status_code=400)
            return HTMLResponse(
                f'<form method="post" action="/login"><input type="hidden" name="request" value="{key}">'
                '<input name="username"><input name="password" type="password"><button>Sign in</button></form>'
            )
        form = await request.form()
        key = str(form.get("request", ""))
        user, password = str(form.get("username", "")), str(form.get("password", ""))
        if key not in self.sign_ins or USERS.get(user) != password:
            return HTMLResponse("wrong user name or password", status_code=401)
        client_id, params = self.sign_ins.pop(key)
        code = secrets.token_urlsafe(24)
        self.codes[code] = AuthorizationCode(
            code=code,
            scopes=params.scopes or [SCOPE],
            expires_at=time.time() + 300,
            client_id=client_id,
            code_challenge=params.code_challenge,
            redirect_uri=params.redirect_uri,
            redirect_uri_provided_explicitly=params.redirect_uri_provided_explicitly,
            resource=params.resource,
            subject=user,
        )
        return RedirectResponse(
            construct_redirect_uri(str(params.redirect_uri), code=code, state=params.state), status_code=302
        )

    async def control_calls(self, request: Request) -> Response:
        return JSONResponse({"calls": self.calls})

    async def control_revoke(self, request: Request) -> Response:
        user = request.query_params.get("user", "")
        for store in (self.access, self.refresh):
            for token, row in list(store.items()):
                if row.subject == user:
                    del store[token]
        return JSONResponse({"revoked": user})

    async def client_token(self, request: Request) -> Response:
        form = await request.form()
        client_id, secret = str(form.get("client_id", "")), str(form.get("client_secret", ""))
        header = request.headers.get("authorization", "")
        if header.lower().startswith("basic "):
            import base64
            from urllib.parse import unquote

            client_id, _, secret = base64.b64decode(header[6:]).decode().partition(":")
            client_id, secret = unquote(client_id), unquote(secret)

        def answer(outcome: str, body: dict, status: int = 200) -> Response:
            self.client_token_requests[outcome] = self.client_token_requests.get(outcome, 0) + 1
            return JSONResponse(body, status_code=status, headers={"Cache-Control": "no-store"})

        if form.get("grant_type") != "client_credentials":
            return answer("refused", {"error": "unsupported_grant_type"}, 400)
        if client_id != MACHINE_CLIENT or not secrets.compare_digest(secret, MACHINE_SECRET):
            return answer("refused", {"error": "invalid_client", "error_description": "bad credentials"}, 401)
        scopes = str(form.get("scope", SCOPE)).split()
        if not set(scopes) <= {SCOPE}:
            return answer("refused", {"error": "invalid_scope"}, 400)
        resource = str(form.get("resource") or form.get("audience") or "") or None
        access = secrets.token_urlsafe(24)
        self.client_tokens.append(access)
        self.access[access] = AccessToken(
            token=access,
            client_id=client_id,
            scopes=scopes,
            expires_at=int(time.time()) + self.token_seconds,
            resource=resource,
            subject=client_id,
        )
        return answer(
            "issued",
            {
                "access_token": access,
                "token_type": "Bearer",
                "expires_in": self.token_seconds,
                "scope": SCOPE,
            },
        )

    async def control_client_tokens(self, request: Request) -> Response:
        return JSONResponse({**self.client_token_requests, "tokens": self.client_tokens})

    async def control_tokens(self, request: Request) -> Response:
        return JSONResponse({"access": len(self.access), "refresh": len(self.refresh)})


def mcp_server(bank: Bank) -> Server[Any]:
    async def on_list_tools(ctx: Any, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        return types.ListToolsResult(
            tools=[
                types.Tool(
                    name="list_statements",
                    description="The signed-in customer's card statements",
                    input_schema={"type": "object", "properties": {"month": {"type": "string"}}},
                )
            ]
        )

    async def on_call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        token = get_access_token()
        subject = token.subject if token else None
        bank.calls.append(
            {"tool": params.name, "subject": subject, "resource": token.resource if token else None}
        )
        result = {"subject": subject, "month": (params.arguments or {}).get("month"), "statements": 2}
        return types.CallToolResult(
            content=[types.TextContent(text=json.dumps(result))], structured_content=result
        )

    return Server("statements", version="1.0", on_list_tools=on_list_tools, on_call_tool=on_call_tool)


def _bind() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def build(token_seconds: int) -> tuple[list[tuple[Starlette, socket.socket]], str, str]:
    as_sock, mcp_sock = _bind(), _bind()
    issuer = f"http://127.0.0.1:{as_sock.getsockname()[1]}"
    resource = f"http://127.0.0.1:{mcp_sock.getsockname()[1]}/mcp"
    bank = Bank(issuer, token_seconds)
    routes = create_auth_routes(
        provider=bank,
        issuer_url=AnyHttpUrl(issuer),
        client_registration_options=ClientRegistrationOptions(
            enabled=True, valid_scopes=[SCOPE], default_scopes=[SCOPE]
        ),
        revocation_options=RevocationOptions(enabled=True),
    )
    routes += [
        Route("/login", bank.login, methods=["GET", "POST"]),
        Route("/control/calls", bank.control_calls),
        Route("/control/revoke", bank.control_revoke, methods=["POST"]),
        Route("/control/tokens", bank.control_tokens),
        Route("/oauth/client-token", bank.client_token, methods=["POST"]),
        Route("/control/client-tokens", bank.control_client_tokens),
    ]
    authorization_server = Starlette(routes=routes)
    resource_server = mcp_server(bank).streamable_http_app(
        streamable_http_path="/mcp",
        auth=AuthSettings(
            issuer_url=AnyHttpUrl(issuer),
            resource_server_url=AnyHttpUrl(resource),
            required_scopes=[SCOPE],
            validate_token_resource=True,
        ),
        token_verifier=ProviderTokenVerifier(bank),
    )
    return [(authorization_server, as_sock), (resource_server, mcp_sock)], issuer, resource


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--token-seconds", type=int, default=3600)
    args = parser.parse_args()
    apps, issuer, resource = build(args.token_seconds)
    servers = []
    for app, sock in apps:
        server = uvicorn.Server(
            uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1, lifespan="on")
        )
        threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
        servers.append(server)
    while not all(s.started for s in servers):
        time.sleep(0.02)
    print(f"{READY} {issuer} {resource}", flush=True)
    anyio.run(anyio.sleep_forever)


if __name__ == "__main__":
    main()


class OAuthServers:
    """This module in its own process, for a test; `sign_in` is the user's browser."""

    def __init__(self, *args: str):
        self.args = list(args)
        self.proc: Any = None
        self.issuer = self.mcp_url = ""

    def start(self, timeout: float = 30) -> OAuthServers:
        import subprocess
        import sys

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.oauth_servers", *self.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith(READY):
                _, self.issuer, self.mcp_url = line.split()
                return self
            if self.proc.poll() is not None:
                break
        raise RuntimeError("OAuth servers did not start")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def calls(self) -> list[dict]:
        import httpx

        return httpx.get(f"{self.issuer}/control/calls", timeout=10).json()["calls"]

    def client_token_requests(self) -> dict:
        """{"issued": n, "refused": n, "tokens": [every token issued]}"""
        import httpx

        return httpx.get(f"{self.issuer}/control/client-tokens", timeout=10).json()

    def forget_tokens_of(self, user: str) -> None:
        import httpx

        httpx.post(f"{self.issuer}/control/revoke", params={"user": user}, timeout=10).raise_for_status()

    def sign_in(self, authorization_url: str, user: str, password: str) -> str:
        """What the user's browser does: open the authorization URL, follow its redirects to the
        sign-in page, sign in; returns where the authorization server sends the browser back."""
        from urllib.parse import parse_qs, urlparse

        import httpx

        with httpx.Client(follow_redirects=True, timeout=10) as browser:
            page = browser.get(authorization_url)
            assert page.status_code == 200, page.text
            request = parse_qs(urlparse(str(page.url)).query)["request"][0]
            back = browser.post(
                f"{self.issuer}/login",
                data={"request": request, "username": user, "password": password},
                follow_redirects=False,
            )
        assert back.status_code == 302, back.text
        return back.headers["location"]
