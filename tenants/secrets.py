"""The tenant's secret values, decrypted once per process, for redaction.

Workers redact tool results, model replies and errors on every step; decrypting (Fernet, one per
secret) costs far more than reading, so the values are kept per process and decrypted again when
the tenant's secrets change.
"""

from __future__ import annotations

import threading

from django.conf import settings

from tenants.crypto import decrypt, redact, redact_obj
from tenants.models import Secret

_secrets: dict[int, tuple[tuple, list[str]]] = {}  # tenant id -> ((id, ciphertext) pairs, values)
_secrets_lock = threading.Lock()


def known_secrets(tenant_id) -> list[str]:
    """The tenant's secret values, for redaction.

    Their ids and ciphertexts are read on every call (a few short rows), so a secret added,
    changed or deleted counts at once.
    """
    stored = list(Secret.objects.filter(tenant_id=tenant_id).order_by("pk").values_list("pk", "ciphertext"))
    version = tuple(stored)
    cached = _secrets.get(tenant_id)
    if cached is not None and cached[0] == version:
        return cached[1]
    values = [decrypt(ciphertext, settings.SECRET_ENCRYPTION_KEYS) for _, ciphertext in stored]
    with _secrets_lock:
        _secrets[tenant_id] = (version, values)
    return values


def redact_text(tenant_id, text: str) -> str:
    return redact(text, known_secrets(tenant_id))


def redact_reply(tenant_id, reply) -> tuple[str, list[dict]]:
    """A model reply's text and tool calls with the tenant's secrets redacted, before they are
    stored or sent.

    A model that got hold of a secret (pasted into a ticket, say) could otherwise copy it into a
    step record or smuggle it out in a tool call's arguments.
    """
    secrets = known_secrets(tenant_id)
    calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in reply.tool_calls]
    return redact(reply.text, secrets), redact_obj(calls, secrets)
