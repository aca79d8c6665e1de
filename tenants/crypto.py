"""Encryption of tenant secrets at rest, and redaction of secrets from text.

Keys are Fernet keys given as a list: the first one encrypts, all of them are
tried for decryption, so a new key can be put in front while old ciphertexts
stay readable until they are rotated.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

REDACTED = "[REDACTED]"
# Shorter values (e.g. "1", "yes") would shred ordinary text when redacted.
MIN_SECRET_LENGTH = 4

__all__ = [
    "MIN_SECRET_LENGTH",
    "REDACTED",
    "SecretKeyError",
    "decrypt",
    "encrypt",
    "generate_key",
    "redact",
    "redact_obj",
    "rotate",
]


class SecretKeyError(ValueError):
    """No usable key: none configured, a malformed key, or no key decrypts the token."""


def generate_key() -> str:
    return Fernet.generate_key().decode("ascii")


def _multi(keys: list[str]) -> MultiFernet:
    if isinstance(keys, str):
        # A bare string would be iterated character by character.
        raise SecretKeyError("keys must be a list of Fernet keys, not a single string")
    if not keys:
        raise SecretKeyError("no encryption keys configured")
    fernets = []
    for index, key in enumerate(keys):
        try:
            fernets.append(Fernet(key))
        except (ValueError, TypeError):
            # The key itself is never echoed: error messages end up in logs.
            raise SecretKeyError(f"encryption key #{index} is not a valid Fernet key") from None
    return MultiFernet(fernets)


def encrypt(plaintext: str, keys: list[str]) -> str:
    return _multi(keys).encrypt(plaintext.encode("utf-8")).decode("ascii")


def decrypt(token: str, keys: list[str]) -> str:
    multi = _multi(keys)
    try:
        data = multi.decrypt(token.encode("utf-8"))
    except InvalidToken:
        raise SecretKeyError(
            f"none of the {len(keys)} configured key(s) can decrypt this secret "
            "(wrong or retired key, or corrupted ciphertext)"
        ) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise SecretKeyError("decrypted secret is not valid UTF-8 text") from None


def rotate(token: str, keys: list[str]) -> str:
    """Re-encrypt a token under the first key, e.g. before retiring an old key."""
    multi = _multi(keys)
    try:
        return multi.rotate(token.encode("utf-8")).decode("ascii")
    except InvalidToken:
        raise SecretKeyError(f"none of the {len(keys)} configured key(s) can decrypt this secret") from None


def _pattern(secrets: Iterable[str]) -> re.Pattern[str] | None:
    values = {s for s in secrets if isinstance(s, str) and len(s) >= MIN_SECRET_LENGTH}
    if not values:
        return None
    # One alternation, longest first, in a single pass: replacing secrets one
    # after another could match inside an earlier "[REDACTED]" or leave the
    # tail of a longer secret that contains a shorter one.
    ordered = sorted(values, key=lambda s: (-len(s), s))
    return re.compile("|".join(re.escape(s) for s in ordered))


def redact(text: str, secrets: Iterable[str]) -> str:
    pattern = _pattern(secrets)
    return pattern.sub(REDACTED, text) if pattern else text


def redact_obj(obj: Any, secrets: Iterable[str]) -> Any:
    """Redacted copy of JSON-like data; dict keys are redacted too.

    Two keys that redact to the same text collapse into one entry (last wins).
    """
    # Built once: ``secrets`` may be a one-shot iterator.
    pattern = _pattern(secrets)
    if pattern is None:
        return _copy(obj, lambda text: text)
    return _copy(obj, lambda text: pattern.sub(REDACTED, text))


def _copy(obj: Any, scrub: Callable[[str], str]) -> Any:
    if isinstance(obj, str):
        return scrub(obj)
    if isinstance(obj, dict):
        return {_copy(key, scrub): _copy(value, scrub) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_copy(item, scrub) for item in obj]
    if isinstance(obj, tuple):
        return tuple(_copy(item, scrub) for item in obj)
    if isinstance(obj, (set, frozenset)):
        return type(obj)(_copy(item, scrub) for item in obj)
    return obj
