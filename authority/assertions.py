"""The signed assertion every HTTP and MCP tool call carries: who acts, for whom, on what call.

Claims (docs/authority.md lists what a provider must check):

    iss     the platform (ASSERTION_ISSUER)        sub      the user who started the run
    aud     the tool server's audience             act      the actor (RFC 8693 section 4.1): the
    tenant  the tenant's slug                               agent, its version and the run
    tool    the tool's remote name                 step     the step's number in the run
    args_digest  sha256 of the arguments' canonical JSON (core.digests, as approvals)
    approval     {"id", "approver", "digest"} when a person approved this exact call
    jti     unique to this assertion (RFC 7519 section 4.1.7): a new one for every attempt and
            every status lookup, so a provider's standard replay cache (refuse a jti seen
            before, until its exp) refuses a replayed assertion and never a legitimate retry
    idempotency_key  the step's idempotency key: the same on every attempt of the call and on
            its status lookups; a provider de-duplicates by it (as by the Idempotency-Key header)
    attempt which attempt of the call this is (1, 2, ...)
    iat, nbf, exp   exp at most ASSERTION_TTL_SECONDS after iat
    purpose "call", or "status_lookup" on a recovery's question "did the call with this
            idempotency_key happen?" (it authorises that question only)

Until issue 40 the jti was the idempotency key, the same on every retry: a provider with a replay
cache had to turn it off or refuse retries. docs/authority.md says how providers move over.

The assertion is built from rows read now (the run, its user, the approval), never from the
model's text: the model can neither see nor shape it.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass

import jwt
from django.conf import settings
from django.utils import timezone

from authority import keys
from core.digests import digest

ALGORITHM = "EdDSA"
TYPE = "agent-assertion+jwt"


@dataclass(frozen=True)
class CallFacts:
    """What an assertion says about one call, read from the database by the caller."""

    tenant: str
    user: str
    agent: str
    version: int
    run_id: str
    step: int
    tool: str
    arguments: dict
    idempotency_key: str
    attempt: int = 1
    approval_id: str | None = None
    approver: str | None = None
    approval_digest: str | None = None


@dataclass(frozen=True)
class Assertion:
    token: str
    jti: str
    subject: str
    audience: str
    key_id: str
    expires_at: dt.datetime


def claims(
    facts: CallFacts, *, audience: str, now: dt.datetime, status_lookup: bool = False, jti: str | None = None
) -> dict:
    issued = int(now.timestamp())
    body: dict = {
        "iss": settings.ASSERTION_ISSUER,
        "sub": facts.user,
        "aud": audience,
        "act": {
            "sub": f"agent:{facts.agent}",
            "agent": facts.agent,
            "version": facts.version,
            "run": facts.run_id,
        },
        "tenant": facts.tenant,
        "tool": facts.tool,
        "step": facts.step,
        "args_digest": digest(facts.arguments),
        "jti": jti or str(uuid.uuid4()),
        "idempotency_key": facts.idempotency_key,
        "attempt": facts.attempt,
        "iat": issued,
        "nbf": issued,
        "exp": issued + settings.ASSERTION_TTL_SECONDS,
        "purpose": "status_lookup" if status_lookup else "call",
    }
    if facts.approval_id:
        body["approval"] = {
            "id": facts.approval_id,
            "approver": facts.approver,
            "digest": facts.approval_digest,
        }
    return body


def sign(
    facts: CallFacts, *, audience: str, now: dt.datetime | None = None, status_lookup: bool = False
) -> Assertion:
    kid, private = keys.signing_key(now)  # None: the key signing now, as this process keeps it
    now = now or timezone.now()
    body = claims(facts, audience=audience, now=now, status_lookup=status_lookup)
    token = jwt.encode(body, private, algorithm=ALGORITHM, headers={"kid": kid, "typ": TYPE})
    return Assertion(
        token=token,
        jti=body["jti"],
        subject=facts.user,
        audience=audience,
        key_id=kid,
        expires_at=dt.datetime.fromtimestamp(body["exp"], tz=dt.UTC),
    )
