"""The platform's signing keys: generate, rotate with an overlap, publish, sign with.

A key's private half is stored only as Fernet ciphertext (the tenants' secrets' keys,
SECRET_ENCRYPTION_KEYS), decrypted once per process and kept in memory by key id. Rotation never
breaks a call in flight: the new key is in the published set `SIGNING_KEY_LEAD_SECONDS` before it
signs, and the old key stays in it until the last assertion it signed has expired
(`ASSERTION_TTL_SECONDS` after it stopped signing), then its private half is erased.

The lead is never shorter than twice JWKS_CACHE_SECONDS, the longest providers are told to cache
the key set (its max-age): a verifier that fetched the set a moment before the new key was
published fetches it again, on its own schedule, before that key signs. It must not count on
fetching again on an unknown `kid`: PyJWT's PyJWKClient does that at most once per 30 s, and a
rotation with a 12 s lead had calls refused for about 10 s.
"""

from __future__ import annotations

import datetime as dt
import json
import secrets
import threading
import time

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone
from jwt.algorithms import OKPAlgorithm

from authority.models import SigningKey
from tenants.crypto import decrypt, encrypt, rotate

_private: dict[str, Ed25519PrivateKey] = {}
_private_lock = threading.Lock()
# The signing key as last read, until a monotonic deadline (signing_key).
_current: dict[str, tuple[float, SigningKey]] = {}
KEY_CHECK_SECONDS = 10


# How long a key stays published after it retired: an assertion's life, 60 s of clock skew, and
# the KEY_CHECK_SECONDS a process may go on signing with it before it reads the table again.
def _publish_horizon(now: dt.datetime) -> dt.datetime:
    return now - dt.timedelta(seconds=settings.ASSERTION_TTL_SECONDS + 60 + KEY_CHECK_SECONDS)


class RotationRefused(ValueError):
    pass


def minimum_lead() -> int:
    """The shortest lead a rotation may have (see the module's opening)."""
    return 2 * settings.JWKS_CACHE_SECONDS


def create_key(*, now: dt.datetime | None = None, lead_seconds: int | None = None) -> SigningKey:
    """Add a key that signs from now + lead; the key signing until then retires at that moment.

    A lead shorter than minimum_lead() raises RotationRefused when a key is signing already (the
    first key has no verifier to surprise)."""
    now = now or timezone.now()
    lead = settings.SIGNING_KEY_LEAD_SECONDS if lead_seconds is None else lead_seconds
    if lead < minimum_lead() and SigningKey.objects.filter(retired_at__isnull=True).exists():
        raise RotationRefused(
            f"a lead of {lead} s is shorter than {minimum_lead()} s (twice JWKS_CACHE_SECONDS): providers "
            "caching the key set would refuse the new key's calls until they fetched it again"
        )
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode("ascii")
    kid = f"ap-{now:%Y%m%d}-{secrets.token_hex(4)}"
    jwk = json.loads(OKPAlgorithm.to_jwk(private.public_key()))
    jwk.update({"kid": kid, "use": "sig", "alg": "EdDSA"})
    starts = now + dt.timedelta(seconds=lead)
    with transaction.atomic():
        # Locked in id order so two rotations at once retire consistently.
        live = list(SigningKey.objects.select_for_update().filter(retired_at__isnull=True).order_by("id"))
        SigningKey.objects.filter(pk__in=[k.pk for k in live]).update(retired_at=starts)
        key = SigningKey.objects.create(
            kid=kid,
            private_ciphertext=encrypt(pem, settings.SECRET_ENCRYPTION_KEYS),
            public_jwk=jwk,
            created_at=now,
            signs_from=now if not live else starts,  # the first key has nobody to overlap with
        )
    _current.clear()
    return key


def signing_key(now: dt.datetime | None = None) -> tuple[str, Ed25519PrivateKey]:
    """The key that signs now (created on first use, so a fresh install needs no step).

    The answer is kept for KEY_CHECK_SECONDS per process: a rotation publishes the next key
    minutes before it signs and keeps the old one published until its last assertion expired,
    so signing a little longer with the old key breaks nothing, and no call reads the table."""
    now_given = now is not None  # a given time: asked about that moment, not cached
    kept = None if now_given else _current.get("key")
    now = now or timezone.now()
    key: SigningKey | None = None
    if kept is not None and kept[0] > time.monotonic():
        key = kept[1]
    else:
        key = _signing_at(now)
        if key is None:
            key = _first_key(now)
        if not now_given:
            _current["key"] = (time.monotonic() + KEY_CHECK_SECONDS, key)
    cached = _private.get(key.kid)
    if cached is None:
        pem = decrypt(key.private_ciphertext, settings.SECRET_ENCRYPTION_KEYS)
        loaded = serialization.load_pem_private_key(pem.encode("ascii"), password=None)
        assert isinstance(loaded, Ed25519PrivateKey)
        with _private_lock:
            cached = _private.setdefault(key.kid, loaded)
    return key.kid, cached


def _signing_at(now: dt.datetime) -> SigningKey | None:
    return (
        SigningKey.objects.filter(signs_from__lte=now)
        .filter(Q(retired_at__isnull=True) | Q(retired_at__gt=now))
        .only("kid", "private_ciphertext", "signs_from", "retired_at")
        .order_by("-signs_from", "-id")
        .first()
    )


def _first_key(now: dt.datetime) -> SigningKey:
    """The first key, made on first use. Many calls make their first signature at once (a worker's
    threads as it starts): the ones that lose the race find the winner's key live, and its lead of
    0 s refused as a rotation (RotationRefused, once an engine error that left a refund in
    `dispatching`); they sign with that key, which signs from the moment it was made."""
    try:
        return create_key(now=now, lead_seconds=0)
    except RotationRefused:
        key = _signing_at(timezone.now())
        if key is None:  # a live key that does not sign yet: a rotation's, not the first
            raise
        return key


def published(now: dt.datetime | None = None) -> list[SigningKey]:
    """Keys a verifier may meet: signing, about to sign, or retired less than an assertion's life ago."""
    now = now or timezone.now()
    horizon = _publish_horizon(now)
    return list(SigningKey.objects.filter(Q(retired_at__isnull=True) | Q(retired_at__gt=horizon)))


def jwks(now: dt.datetime | None = None) -> dict:
    return {"keys": [key.public_jwk for key in published(now)]}


def erase_expired(now: dt.datetime | None = None) -> int:
    """Delete keys no assertion in circulation can name any more (their private halves with them)."""
    now = now or timezone.now()
    horizon = _publish_horizon(now)
    deleted, _ = SigningKey.objects.filter(retired_at__lte=horizon).delete()
    return deleted


def rotate_ciphertexts() -> int:
    """Re-encrypt every private half under the first SECRET_ENCRYPTION_KEYS key (before retiring one)."""
    count = 0
    for key in SigningKey.objects.all():
        SigningKey.objects.filter(pk=key.pk).update(
            private_ciphertext=rotate(key.private_ciphertext, settings.SECRET_ENCRYPTION_KEYS)
        )
        count += 1
    return count
