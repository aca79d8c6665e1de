"""Cost of delegated authority per tool call: signing an assertion and verifying it.

    python bench/authority.py [N]

Signs N assertions with the platform's claims (EdDSA over Ed25519, PyJWT + cryptography, what
authority/assertions.py does once per attempt) and verifies each as docs/authority.md tells a
provider to (signature, iss, aud, exp, the argument digest). Target: under 1 ms each. Needs no
database: the key is generated here and the claims are built by the product's own function.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "agentplatform.settings")

import django

django.setup()

import jwt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.conf import settings

from authority.assertions import ALGORITHM, TYPE, CallFacts, claims

ARGS = {"transaction_id": "TXN-1001", "amount": 12499, "currency": "INR", "reason": "duplicate charge"}
FACTS = CallFacts(
    tenant="acme",
    user="asha",
    agent="dispute-agent",
    version=2,
    run_id="6a7db62f-dd99-4133-a9da-318ac8ce8f61",
    step=4,
    tool="issue_refund",
    arguments=ARGS,
    idempotency_key="6a7db62f-dd99-4133-a9da-318ac8ce8f61:4",
    approval_id="0b5e3a54-4d39-4f36-9f8e-7c2ad0b1f3a1",
    approver="ravi",
    approval_digest="9" * 64,
)


def main(n: int = 2000) -> dict:
    private = Ed25519PrivateKey.generate()
    public = private.public_key()
    audience = "https://core-banking.bank.example"
    sign_times, verify_times, tokens = [], [], []
    for _ in range(n):
        began = time.perf_counter()
        body = claims(FACTS, audience=audience, now=dt.datetime.now(dt.UTC))
        tokens.append(jwt.encode(body, private, algorithm=ALGORITHM, headers={"kid": "bench", "typ": TYPE}))
        sign_times.append(time.perf_counter() - began)
    for token in tokens:
        began = time.perf_counter()
        decoded = jwt.decode(
            token,
            public,
            algorithms=["EdDSA"],
            audience=audience,
            issuer=settings.ASSERTION_ISSUER,
            leeway=30,
        )
        canonical = json.dumps(ARGS, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        assert decoded["args_digest"] == hashlib.sha256(canonical.encode()).hexdigest()
        verify_times.append(time.perf_counter() - began)

    def figures(times: list[float]) -> dict:
        ordered = sorted(times)
        return {
            "median_ms": round(statistics.median(ordered) * 1000, 3),
            "p99_ms": round(ordered[int(len(ordered) * 0.99) - 1] * 1000, 3),
        }

    result = {
        "n": n,
        "sign": figures(sign_times),
        "verify": figures(verify_times),
        "token_bytes": len(tokens[0]),
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000)
