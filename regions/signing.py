"""Requests between regions, signed with the pair's shared key (HMAC-SHA256), both ways.

| call                  | who signs       | what is signed                                        |
|-----------------------|-----------------|-------------------------------------------------------|
| request               | the asking region | method, path, region name, timestamp, body's SHA-256 |
| answer                | the home          | the request's signature, status code, body's SHA-256  |

A request is refused (403) when its region is unknown, its signature does not match, or its
timestamp is more than MAX_SKEW_SECONDS away from the home's clock. A repeat inside that window
is harmless: every operation is idempotent by the request id in its body. The answer is signed
over the request's signature, so a forged or replayed answer (a grant the home never made,
which would raise a region's limit) is refused by the region. Keys are per pair of regions
(settings.REGION_KEYS); both sides hold the same one. Mutual TLS in front is a deployment
choice on top, not a replacement: the signature binds the body, TLS only the connection.
"""

from __future__ import annotations

import hashlib
import hmac
import time

MAX_SKEW_SECONDS = 30.0
REGION, TIMESTAMP, SIGNATURE = "X-Region", "X-Region-Timestamp", "X-Region-Signature"
ANSWER_SIGNATURE = "X-Region-Answer-Signature"


class BadSignature(Exception):
    pass


def _mac(key: str, *parts: str | bytes) -> str:
    mac = hmac.new(key.encode(), digestmod=hashlib.sha256)
    for part in parts:
        mac.update(part if isinstance(part, bytes) else part.encode())
        mac.update(b"\n")
    return mac.hexdigest()


def sign_request(
    *, key: str, region: str, method: str, path: str, body: bytes, now: float | None = None
) -> dict:
    stamp = f"{now if now is not None else time.time():.3f}"
    return {
        REGION: region,
        TIMESTAMP: stamp,
        SIGNATURE: _mac(key, method.upper(), path, region, stamp, hashlib.sha256(body).hexdigest()),
    }


def verify_request(
    *, keys: dict[str, str], headers, method: str, path: str, body: bytes, now: float | None = None
) -> str:
    """The asking region's name, or BadSignature."""
    region, stamp, signature = headers.get(REGION, ""), headers.get(TIMESTAMP, ""), headers.get(SIGNATURE, "")
    key = keys.get(region)
    if not key or not signature:
        raise BadSignature(f"no key for region {region!r}" if not key else "the request is not signed")
    try:
        skew = abs((now if now is not None else time.time()) - float(stamp))
    except ValueError:
        raise BadSignature("bad timestamp") from None
    if skew > MAX_SKEW_SECONDS:
        raise BadSignature(f"timestamp {skew:.0f} s away from this region's clock")
    expected = _mac(key, method.upper(), path, region, stamp, hashlib.sha256(body).hexdigest())
    if not hmac.compare_digest(expected, signature):
        raise BadSignature("signature does not match")
    return region


def sign_answer(*, key: str, request_signature: str, status: int, body: bytes) -> str:
    return _mac(key, request_signature, str(status), hashlib.sha256(body).hexdigest())


def verify_answer(*, key: str, request_signature: str, status: int, body: bytes, signature: str) -> None:
    expected = sign_answer(key=key, request_signature=request_signature, status=status, body=body)
    if not hmac.compare_digest(expected, signature or ""):
        raise BadSignature("the answer is not signed by the home region")
