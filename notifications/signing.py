"""How a delivery is signed: `X-Signature: sha256=<hex HMAC-SHA256 of "<timestamp>.<body>">`.

The timestamp (`X-Timestamp`, Unix seconds of the attempt) is inside the signed text, so a
captured request cannot be replayed later with a fresh timestamp. Receivers verify with the
snippet in docs/notifications.md (tests/notifications/test_signature.py runs that snippet).
"""

from __future__ import annotations

import hashlib
import hmac

SIGNATURE_HEADER = "X-Signature"
TIMESTAMP_HEADER = "X-Timestamp"


def signature(secret: str, timestamp: str, body: bytes) -> str:
    mac = hmac.new(secret.encode("utf-8"), timestamp.encode("ascii") + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()
