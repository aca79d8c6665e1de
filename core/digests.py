"""Content digests: the same value always hashes the same (approvals bind to them, versions and
requests are compared by them)."""

from __future__ import annotations

import hashlib
import json


def canonical_json(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def digest(value) -> str:
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()
