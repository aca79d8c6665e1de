"""A tenant's identity provider for the tests: Authlib's OAuth 2 authorization server (its token
endpoint, client authentication, error responses) with an RFC 8693 token-exchange grant.

Authlib 1.9 ships the framework and the grant extension point but no token-exchange grant
(`authlib.oauth2.rfc8693` is empty), so the grant is written here on Authlib's `BaseGrant`, the way
its own JWT-bearer grant (RFC 7523) is; the subject token is verified with joserfc against the
platform's published key set. Served on 127.0.0.1 in a thread; it counts the exchanges it answers.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl

import httpx
from authlib.oauth2 import AuthorizationServer
from authlib.oauth2.rfc6749 import (
    AccessDeniedError,
    BaseGrant,
    ClientMixin,
    InvalidGrantError,
    InvalidRequestError,
    OAuth2Request,
    TokenEndpointMixin,
)
from authlib.oauth2.rfc6749.requests import BasicOAuth2Payload
from joserfc import jwk, jwt
from joserfc.errors import JoseError

GRANT = "urn:ietf:params:oauth:grant-type:token-exchange"
JWT_TYPE = "urn:ietf:params:oauth:token-type:jwt"
ACCESS_TYPE = "urn:ietf:params:oauth:token-type:access_token"


class Client(ClientMixin):
    def __init__(self, client_id: str, secret: str):
        self.client_id, self.secret = client_id, secret

    def get_client_id(self):
        return self.client_id

    def check_client_secret(self, client_secret):
        return client_secret == self.secret

    def check_endpoint_auth_method(self, method, endpoint):
        return method == "client_secret_basic" and endpoint == "token"

    def check_grant_type(self, grant_type):
        return grant_type == GRANT

    def get_allowed_scope(self, scope):
        return scope


class TokenExchangeGrant(BaseGrant, TokenEndpointMixin):
    GRANT_TYPE = GRANT
    TOKEN_ENDPOINT_AUTH_METHODS = ["client_secret_basic"]

    def validate_token_request(self):
        client = self.authenticate_token_endpoint_client()
        form = self.request.payload.data
        if form.get("subject_token_type") != JWT_TYPE or not form.get("subject_token"):
            raise InvalidRequestError(description="subject_token of type jwt is required")
        idp: TokenServer = self.server.idp
        try:
            token = jwt.decode(form["subject_token"], idp.platform_keys(), algorithms=["EdDSA"])
            jwt.JWTClaimsRegistry(
                iss={"essential": True, "value": idp.platform_issuer},
                exp={"essential": True},
                sub={"essential": True},
            ).validate(token.claims)
        except JoseError as exc:
            raise InvalidGrantError(description=f"subject token rejected: {exc.description}") from exc
        claims = token.claims
        audience = form.get("audience", "")
        if claims.get("aud") != audience:
            raise InvalidGrantError(description="the subject token was issued for another audience")
        if claims["sub"] in idp.refused:
            raise AccessDeniedError(description=idp.refused[claims["sub"]])
        self.request.client = client
        self.request.user = claims["sub"]
        self.request.credential = claims

    def create_token_response(self):
        idp: TokenServer = self.server.idp
        claims, form = self.request.credential, self.request.payload.data
        now = int(time.time())
        issued = {
            "iss": idp.url,
            "sub": claims["sub"],
            "aud": form["audience"],
            "scope": form.get("scope", ""),
            "act": {"sub": self.request.client.client_id, "act": claims.get("act")},
            "iat": now,
            "exp": now + idp.lifetime,
            "jti": uuid.uuid4().hex,
        }
        access = jwt.encode({"alg": "ES256", "kid": "idp-1"}, issued, idp.key)
        idp.exchanges.append({"sub": claims["sub"], "aud": form["audience"], "scope": form.get("scope", "")})
        body = {
            "access_token": access,
            "issued_token_type": ACCESS_TYPE,
            "token_type": "Bearer",
            "expires_in": idp.lifetime,
            "scope": form.get("scope", ""),
        }
        return 200, body, self.TOKEN_RESPONSE_HEADER


class _Server(AuthorizationServer):
    def __init__(self, idp: TokenServer):
        super().__init__()
        self.idp = idp

    def query_client(self, client_id):
        return self.idp.client if client_id == self.idp.client.client_id else None

    def save_token(self, token, request):
        return None

    def send_signal(self, name, *args, **kwargs):
        return None

    def create_oauth2_request(self, request) -> OAuth2Request:
        return request

    def handle_response(self, status, body, headers):
        return status, body, headers


class TokenServer:
    """Start with `.start()`; `token_url`, `refused` (user -> reason), `exchanges` (answered)."""

    def __init__(self, *, platform_jwks_url: str, platform_issuer: str, lifetime: int = 600):
        self.client = Client("agent-platform", "idp-client-secret-6Yq1-canary")
        self.platform_jwks_url, self.platform_issuer = platform_jwks_url, platform_issuer
        self.lifetime = lifetime
        self.key = jwk.ECKey.generate_key("P-256", parameters={"kid": "idp-1"})
        self.refused: dict[str, str] = {}
        self.exchanges: list[dict] = []
        self.down = False  # answer 503, as an IdP in maintenance does
        self.server = _Server(self)
        self.server.register_grant(TokenExchangeGrant)
        self._http: ThreadingHTTPServer | None = None

    def platform_keys(self):
        return jwk.KeySet.import_key_set(httpx.get(self.platform_jwks_url, timeout=10).json())

    def public_keys(self):
        return jwk.KeySet.import_key_set({"keys": [self.key.as_dict(private=False)]})

    @property
    def url(self) -> str:
        assert self._http is not None
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    @property
    def token_url(self) -> str:
        return f"{self.url}/token"

    def start(self) -> TokenServer:
        idp = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                form = dict(parse_qsl(self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()))
                if idp.down:
                    status, body, headers = 503, {"error": "temporarily_unavailable"}, []
                else:
                    request = OAuth2Request("POST", f"{idp.url}{self.path}", headers=dict(self.headers))
                    request.payload = BasicOAuth2Payload(form)
                    status, body, headers = idp.server.create_token_response(request)
                payload = json.dumps(body).encode()
                self.send_response(status)
                for name, value in headers:
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
