"""Sealing a run's content with its data key.

A run's data key (32 random bytes) is made when its first content is sealed, wrapped by the
tenant's key and kept in the key store (vault/store.py). The tenant's key is derived (HKDF-SHA256,
labelled with the tenant) from each of CONTENT_KEYS, so a new one can be put in front and old
wrappings still open. A sealed value is `version || key fingerprint || nonce || AES-256-GCM(
plaintext)`, bound by its associated data to its run and its purpose: moved to another run or
column it does not open; sealed by a key since destroyed, it says so even when the run has a
newer key.

Unwrapped keys are kept per process for KEY_CACHE_SECONDS, so reading a run's content costs no
round trip to the store; a key destroyed elsewhere stops opening content here at most that long
after (a run must have ended to be erased). `seal` reads the key from the store every time: a
file stored after an erasure is never sealed with a key already destroyed. `seal_value` (a
column's value: vault/fields.py) takes the key this process holds, since only an open run's rows
are written and an open run is never erased; a late write to an erased run sealed with the
destroyed key is as erased as the rest of it. A column value also names its run, so that it
opens from the row alone: `VALUE_VERSION || run id (16) || key fingerprint || nonce || AES-GCM`.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import os
import threading
import time
import uuid

from cryptography.exceptions import InvalidTag
from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings

from vault import store
from vault.store import KeyDestroyed, KeyStoreUnavailable

__all__ = [
    "KeyDestroyed",
    "KeyStoreUnavailable",
    "open_value",
    "run_of",
    "seal",
    "seal_value",
    "seal_with",
    "make_keys",
    "query_lexemes",
    "search_lexemes",
    "shred",
    "unseal",
    "word_hashes",
]

KEY_CACHE_SECONDS = 60.0
VERSION = b"\x01"  # a sealed value: VERSION || key fingerprint (4) || nonce (12) || AES-256-GCM
VALUE_VERSION = b"\x02"  # a sealed column value: VALUE_VERSION || run id (16) || as VERSION's
WORDS_KEY = "words:"  # the key store's id of a tenant's word key, before the tenant's id
_CACHE_LIMIT = 4096
_cache: dict[str, tuple[bytes, bytes, float]] = {}  # run id -> (key, its wrapping, when read)
_ciphers: dict[bytes, tuple[AESGCM, bytes]] = {}  # key -> its cipher and fingerprint
_lock = threading.Lock()


def seal(run_id, tenant, plaintext: bytes, purpose: str) -> bytes:
    # The key read from the store, not the cache: sealed with a key another process destroyed a
    # moment ago (an erasure), new content would never open again.
    cipher, fingerprint = _cipher(_data_key(run_id, tenant, make=True, cached=False))
    nonce = os.urandom(12)
    return VERSION + fingerprint + nonce + cipher.encrypt(nonce, plaintext, _aad(run_id, purpose))


def unseal(run_id, tenant, sealed: bytes, purpose: str) -> bytes:
    """The plaintext; KeyDestroyed when the key that sealed it is gone (the run's content erased:
    the run may hold a newer key since, which does not open it); InvalidTag when the bytes were
    altered."""
    if sealed[:1] != VERSION:
        raise InvalidTag()
    cipher = _opening(run_id, tenant, sealed[1:5])
    return cipher.decrypt(sealed[5:17], sealed[17:], _aad(run_id, purpose))


def seal_value(run_id, plaintext: bytes, purpose: str, *, tenant) -> bytes:
    """A column value of the run, sealed with the key this process holds (the module says why);
    `tenant`, or a callable giving it, is asked only when the run has no key yet."""
    return seal_with(_data_key(run_id, tenant, make=True), run_id, plaintext, purpose)


def seal_with(key: bytes, run_id, plaintext: bytes, purpose: str) -> bytes:
    """A column value of the run sealed with `key`, the run's (seal_value's, or make_keys')."""
    cipher, fingerprint = _cipher(key)
    nonce = os.urandom(12)
    head = VALUE_VERSION + uuid.UUID(str(run_id)).bytes
    return head + fingerprint + nonce + cipher.encrypt(nonce, plaintext, _aad(run_id, purpose))


def make_keys(tenant, run_ids) -> dict[str, bytes]:
    """New keys for runs written in bulk (a benchmark's million), kept in the store in one
    statement: {run id: key}. A run holding a key already keeps it and is left out."""
    keys = {str(r): os.urandom(32) for r in run_ids}
    wrapping = _tenant_keys(str(tenant), tuple(settings.CONTENT_KEYS))
    kept = store.put_many([(run_id, str(tenant), wrapping.encrypt(key)) for run_id, key in keys.items()])
    return {run_id: key for run_id, key in keys.items() if run_id in kept}


def run_of(sealed: bytes) -> uuid.UUID:
    """The run a sealed column value belongs to (InvalidTag: not a sealed value)."""
    if sealed[:1] != VALUE_VERSION or len(sealed) < 33:
        raise InvalidTag()
    return uuid.UUID(bytes=bytes(sealed[1:17]))


def open_value(sealed: bytes, purpose: str) -> bytes:
    """A sealed column value's plaintext; KeyDestroyed when its run's content was erased;
    InvalidTag when the bytes were altered (or moved from another run or column)."""
    run_id = run_of(sealed)
    cipher = _opening(run_id, None, bytes(sealed[17:21]))
    return cipher.decrypt(bytes(sealed[21:33]), bytes(sealed[33:]), _aad(run_id, purpose))


def _opening(run_id, tenant, fingerprint: bytes) -> AESGCM:
    """The cipher of the run's key that sealed a value (its fingerprint); KeyDestroyed when the
    run no longer holds that key (its content erased: it may hold a newer one since)."""
    cipher, held = _cipher(_data_key(run_id, tenant, make=False))
    if held != fingerprint:
        # This process's copy may be stale: the store's.
        cipher, held = _cipher(_data_key(run_id, tenant, make=False, cached=False))
        if held != fingerprint:
            raise KeyDestroyed(run_id)
    return cipher


def _cipher(key: bytes) -> tuple[AESGCM, bytes]:
    """The key's cipher and fingerprint, made once a key (each costs more than a short value's sealing)."""
    found = _ciphers.get(key)
    if found is None:
        if len(_ciphers) >= _CACHE_LIMIT:
            _ciphers.clear()
        found = _ciphers[key] = (AESGCM(key), _fingerprint(key))
    return found


def word_hashes(tenant, words) -> list[int]:
    """Keyed 64-bit hashes of the words (HMAC-SHA256 with the tenant's word key, a key like a run's
    kept in the key store under `words:<tenant>`): an index of them, in a backup, confirms no
    guess without that key. Sorted and distinct."""
    key = _word_key(tenant)
    return sorted(
        {
            int.from_bytes(hmac.new(key, w.encode(), hashlib.sha256).digest()[:8], "big", signed=True)
            for w in words
        }
    )


def keyed_digest(tenant, text: str) -> str:
    """A keyed digest of a short text (HMAC-SHA256 with the tenant's word key, hex): what a unique
    constraint compares where the text itself is sealed (an artifact's name), confirming no
    guess without that key."""
    return hmac.new(_word_key(tenant), b"text|" + text.encode(), hashlib.sha256).hexdigest()


def search_lexemes(tenant, tokens) -> list[str]:
    """Keyed lexemes of a document's tokens (vault/keyed_search.py), in their order: the first 64
    bits of HMAC-SHA256 with the tenant's word key (made if missing), in hex; a token's hash in no
    other tenant's search."""
    return _lexemes(_word_key(tenant), tokens)


def query_lexemes(tenant, tokens) -> list[str] | None:
    """The same for a query's tokens; None when the tenant has no word key, so no stored words to
    match. A search does not make one (an operator's search over every tenant made a key for each
    tenant without runs)."""
    key = _existing_word_key(tenant)
    return None if key is None else _lexemes(key, tokens)


def _lexemes(key: bytes, tokens) -> list[str]:
    return [hmac.new(key, b"search|" + t.encode(), hashlib.sha256).hexdigest()[:16] for t in tokens]


def _word_key(tenant) -> bytes:
    """The tenant's word key: made, and kept in the key store, like a run's."""
    return _data_key(f"{WORDS_KEY}{tenant}", tenant, make=True)


def _existing_word_key(tenant) -> bytes | None:
    """The tenant's word key if it has one (None: never made, or destroyed with its history)."""
    try:
        return _data_key(f"{WORDS_KEY}{tenant}", tenant, make=False)
    except KeyDestroyed:
        return None


def shred(run_ids) -> int:
    """Destroy the runs' keys (here and in the store); how many the store held."""
    ids = [str(r) for r in run_ids]
    with _lock:
        for run_id in ids:
            _cache.pop(run_id, None)
    return store.destroy(ids)


def rewrap_all(*, page: int = 500) -> tuple[int, int]:
    """Wrap every run's data key with the first of CONTENT_KEYS (after a new one was put in front),
    so that the older ones can be retired; (rewrapped, already so). The data keys, and so every
    sealed value, stay as they are."""
    rewrapped = current = 0
    after = ""
    while True:
        rows = store.wrapped_page(after, page)
        if not rows:
            return rewrapped, current
        after = rows[-1][0]
        for run_id, tenant, wrapped in rows:
            if _wrapped_by_first(wrapped, tenant):
                current += 1
                continue
            try:
                fresh = _tenant_keys(str(tenant), tuple(settings.CONTENT_KEYS)).rotate(wrapped)
            except InvalidToken:
                raise KeyStoreUnavailable(
                    f"run {run_id}'s key is wrapped by none of CONTENT_KEYS: put the old key back (after the new one)"
                ) from None
            rewrapped += store.rewrap(run_id, wrapped, fresh)


def _wrapped_by_first(wrapped: bytes, tenant: str) -> bool:
    try:
        _tenant_keys(str(tenant), (settings.CONTENT_KEYS[0],)).decrypt(wrapped)
        return True
    except InvalidToken:
        return False


def forget_cached() -> None:
    with _lock:
        _cache.clear()
        _ciphers.clear()


def _fingerprint(key: bytes) -> bytes:
    """Which key sealed a value (4 bytes of a hash of it: nothing to learn the key from)."""
    return hashlib.sha256(b"content-key-fingerprint|" + key).digest()[:4]


def _aad(run_id, purpose: str) -> bytes:
    return f"{run_id}|{purpose}".encode()


def _data_key(run_id, tenant, *, make: bool, cached: bool = True) -> bytes:
    run_id = str(run_id)
    now = time.monotonic()
    with _lock:
        held = _cache.get(run_id)
    if cached and held is not None and now - held[2] < KEY_CACHE_SECONDS:
        return held[0]
    found = store.held(run_id)
    if found is None:
        if not make:
            raise KeyDestroyed(run_id)
        if callable(tenant):
            tenant = tenant()
        wrapped = store.put(
            run_id, tenant, _tenant_keys(str(tenant), tuple(settings.CONTENT_KEYS)).encrypt(os.urandom(32))
        )
        owner = str(tenant)
    else:
        wrapped, owner = found  # wrapped for the tenant the store names
    if held is not None and held[1] == wrapped:
        key = held[0]  # the store still holds the key this process unwrapped: no unwrap again
    else:
        try:
            key = _tenant_keys(owner, tuple(settings.CONTENT_KEYS)).decrypt(wrapped)
        except InvalidToken:
            raise KeyStoreUnavailable(
                f"run {run_id}'s key is wrapped by none of CONTENT_KEYS (a key removed too soon?)"
            ) from None
    with _lock:
        if len(_cache) >= _CACHE_LIMIT:
            _cache.clear()  # rare: a process touching thousands of runs within a minute
        _cache[run_id] = (key, wrapped, now)
    return key


@functools.lru_cache(maxsize=1024)
def _tenant_keys(tenant: str, masters: tuple[str, ...]) -> MultiFernet:
    """The tenant's keys, one per master (keyed by the masters too: a rotation derives anew)."""
    return MultiFernet([Fernet(_derive(master, tenant)) for master in masters])


def _derive(master: str, tenant: str) -> bytes:
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=f"content-key|tenant:{tenant}".encode())
    return base64.urlsafe_b64encode(hkdf.derive(base64.urlsafe_b64decode(master)))
