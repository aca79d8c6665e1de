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


class _Scrubber:
    """Replaces every occurrence of the secrets in a text with REDACTED, in a single pass.

    One alternation, longest first: replacing secrets one after another could match inside an
    earlier "[REDACTED]" or leave the tail of a longer secret that contains a shorter one. Only
    the secrets the text holds go into it (one that does not occur cannot match), so the common
    cases need no regular expression at all: a text with none, or with one (a literal replace).
    That matters because some secrets are new on every call (the signed assertion of a tool
    call), and compiling a pattern of them each time cost about a millisecond a step.
    """

    def __init__(self, secrets: Iterable[str]):
        values = {s for s in secrets if isinstance(s, str) and len(s) >= MIN_SECRET_LENGTH}
        self.ordered = sorted(values, key=lambda s: (-len(s), s))

    def __bool__(self) -> bool:
        return bool(self.ordered)

    def __call__(self, text: str) -> str:
        present = [s for s in self.ordered if s in text]
        if not present:
            return text
        if len(present) == 1:
            return text.replace(present[0], REDACTED)
        return re.compile("|".join(re.escape(s) for s in present)).sub(REDACTED, text)


def redact(text: str, secrets: Iterable[str]) -> str:
    scrub = _Scrubber(secrets)
    return scrub(text) if scrub else text


def redact_obj(obj: Any, secrets: Iterable[str]) -> Any:
    """Redacted copy of JSON-like data; dict keys are redacted too.

    Two keys that redact to the same text collapse into one entry (last wins).
    """
    # Built once: ``secrets`` may be a one-shot iterator.
    scrub = _Scrubber(secrets)
    if not scrub:
        return _copy(obj, lambda text: text)
    return _copy(obj, scrub)


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
