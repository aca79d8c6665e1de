"""Calls from a region to a tenant's home region: signed requests, signed answers.

Error contract (as tools/transports.py's): every failure raises HomeUnreachable and is "maybe
done": the home may have applied the request and its answer been lost. The caller keeps the
request pending and sends it again with the same request id; the home answers a repeat with
the first answer (regions.services.grant / take_back), so a lost reply never doubles a slice.
A request is only ever applied on this side from a verified answer. No retries here: the slice
keeper's next pass is the retry. Never called inside a transaction (no lock is held across it).
"""

from __future__ import annotations

import json

import httpx
from django.conf import settings
from django.db import connection

from regions.models import here
from regions.signing import ANSWER_SIGNATURE, SIGNATURE, BadSignature, sign_request, verify_answer

GRANT_PATH = "/v1/regions/slices/grant"
RETURN_PATH = "/v1/regions/slices/return"
PROBE_PATH = "/v1/regions/probe"
AUTHORITY_PATH = "/v1/regions/authority"


class HomeUnreachable(Exception):
    pass


def call_home(home: str, path: str, payload: dict) -> dict:
    if connection.in_atomic_block:
        raise RuntimeError("no call between regions inside a transaction")
    try:
        url, key = settings.REGION_PEERS[home], settings.REGION_KEYS[home]
    except KeyError:
        raise HomeUnreachable(f"region {home!r} is not configured (REGION_PEERS, REGION_KEYS)") from None
    body = json.dumps(payload, sort_keys=True).encode()
    headers = sign_request(key=key, region=here(), method="POST", path=path, body=body)
    try:
        response = httpx.post(
            url.rstrip("/") + path,
            content=body,
            headers={**headers, "Content-Type": "application/json"},
            timeout=settings.REGION_TIMEOUT_SECONDS,
        )
    except httpx.HTTPError as exc:
        raise HomeUnreachable(f"{type(exc).__name__}: {exc}") from None
    try:
        verify_answer(
            key=key,
            request_signature=headers[SIGNATURE],
            status=response.status_code,
            body=response.content,
            signature=response.headers.get(ANSWER_SIGNATURE, ""),
        )
    except BadSignature as exc:
        raise HomeUnreachable(f"answer refused: {exc} (HTTP {response.status_code})") from None
    if response.status_code != 200:
        raise HomeUnreachable(f"home answered HTTP {response.status_code}: {response.text[:300]}")
    return response.json()
