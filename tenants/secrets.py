"""The tenant's secret values, decrypted once per process, for redaction.

Workers redact tool results, model replies and errors on every step; decrypting (Fernet, one per
secret) costs far more than reading, and reading the secrets on every step costs a query of rows
that almost never change. So the values are kept per process under the tenant's
`secrets_generation`, a number a database trigger moves in the same transaction as every write
of the tenant's secrets (tenants/migrations/0005). A step reads only that number (one short
primary-key read of the tenant's row) and reads and decrypts the secrets again only when it moved.

Why that is safe across processes: the number and the secrets commit together, so a reader that
can see a secret added, changed or deleted a moment ago also sees the new number, and reloads;
a reader that sees the old number sees the old secrets, which are what its cache holds. The
reload reads the number and the secrets in one statement (one snapshot), so a cache entry never
holds fewer secrets than its number promises.
"""

from __future__ import annotations

import threading

from django.conf import settings
from django.db import connection

from tenants.crypto import decrypt, redact, redact_obj
from tenants.models import Secret, Tenant

_secrets: dict[int, tuple[int | None, list[str]]] = {}  # tenant id -> (secrets_generation, values)
_secrets_lock = threading.Lock()


def known_secrets(tenant_id, *, generation: int | None = None) -> list[str]:
    """The tenant's secret values, for redaction: a secret written a moment ago counts at once.

    `generation`: the tenant's secrets_generation as the caller read it in this transaction (the
    engine's record reads it with the run's lock); otherwise it is read here (one query).
    """
    cached = _secrets.get(tenant_id)
    if cached is not None and cached[0] == (generation if generation is not None else _generation(tenant_id)):
        return cached[1]
    generation, stored = _load(tenant_id)
    values = [decrypt(ciphertext, settings.SECRET_ENCRYPTION_KEYS) for ciphertext in stored]
    with _secrets_lock:
        _secrets[tenant_id] = (generation, values)
    return values


def _generation(tenant_id) -> int | None:
    with connection.cursor() as cursor:
        cursor.execute(_sql()["generation"], [tenant_id])
        row = cursor.fetchone()
    return row[0] if row else None


def _load(tenant_id) -> tuple[int | None, list[str]]:
    """The tenant's generation and its secrets' ciphertexts, read in one statement."""
    with connection.cursor() as cursor:
        cursor.execute(_sql()["load"], [tenant_id])
        rows = cursor.fetchall()
    if not rows:
        return None, []
    return rows[0][0], [ciphertext for _, ciphertext in rows if ciphertext is not None]


_statements: dict[str, str] = {}


def _sql() -> dict[str, str]:
    if not _statements:
        tenant, secret = Tenant._meta.db_table, Secret._meta
        column = secret.get_field("tenant").column
        _statements["generation"] = f'SELECT secrets_generation FROM "{tenant}" WHERE id = %s'
        _statements["load"] = (
            f'SELECT t.secrets_generation, s.ciphertext FROM "{tenant}" t '
            f'LEFT JOIN "{secret.db_table}" s ON s."{column}" = t.id WHERE t.id = %s ORDER BY s.id'
        )
    return _statements


def redact_text(tenant_id, text: str, *, generation: int | None = None) -> str:
    return redact(text, known_secrets(tenant_id, generation=generation))


def redact_reply(tenant_id, reply, *, generation: int | None = None) -> tuple[str, list[dict]]:
    """A model reply's text and tool calls with the tenant's secrets redacted, before they are
    stored or sent.

    A model that got hold of a secret (pasted into a ticket, say) could otherwise copy it into a
    step record or smuggle it out in a tool call's arguments.
    """
    secrets = known_secrets(tenant_id, generation=generation)
    calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in reply.tool_calls]
    return redact(reply.text, secrets), redact_obj(calls, secrets)
