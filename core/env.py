"""Small readers for environment variables that fail loudly on bad values."""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from typing import overload


class ConfigError(RuntimeError):
    pass


@overload
def env_str(name: str, default: str) -> str: ...
@overload
def env_str(name: str, default: None = None) -> str | None: ...
def env_str(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return default if value in (None, "") else value


def env_required(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise ConfigError(f"{name} must be set in production")
    return value


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = env_str(name, default)
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def env_int(name: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {value!r}") from None
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise ConfigError(f"{name} must be from {minimum} to {maximum}, got {number}")
    return number


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {value!r}") from None


_RATE = re.compile(r"\d+/(s|sec|second|m|min|minute|h|hour|d|day)")


def env_rate(name: str, default: str) -> str:
    """A DRF throttle rate such as "10/min"."""
    value = (os.environ.get(name) or default).strip()
    if not _RATE.fullmatch(value) or int(value.split("/")[0]) < 1:
        raise ConfigError(f"{name} must be a rate such as 10/min (per s, min, hour or day), got {value!r}")
    return value


def env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name} must be true or false, got {value!r}")


def env_list(name: str, default: list[str]) -> list[str]:
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    return [item.strip() for item in value.split(",") if item.strip()]


def env_pairs(name: str) -> dict[str, str]:
    """`a=1,b=2` as {"a": "1", "b": "2"}; an item without `=` or with an empty side fails loudly."""
    pairs = {}
    for item in env_list(name, []):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ConfigError(f"{name}: {item!r} is not name=value")
        pairs[key.strip()] = value.strip()
    return pairs


# A Django SECRET_KEY signs sessions, password-reset links and CSRF tokens: it must be long and
# random. Django's own deploy check asks for 50 characters, 5 distinct ones and no
# "django-insecure-" prefix; the entropy floor also refuses long keys of repeated patterns.
SECRET_KEY_MIN_LENGTH = 50
SECRET_KEY_MIN_BITS = 128


def strong_secret_key(name: str, value: str) -> str:
    """`value` if it is a usable secret key; raise ConfigError (without echoing it) otherwise."""
    if value.startswith("django-insecure"):
        raise ConfigError(
            f"{name} is Django's generated development key (django-insecure-...); generate a new one"
        )
    if len(value) < SECRET_KEY_MIN_LENGTH:
        raise ConfigError(f"{name} must be at least {SECRET_KEY_MIN_LENGTH} characters, got {len(value)}")
    counts = Counter(value)
    bits = sum(n * math.log2(len(value) / n) for n in counts.values())
    if len(counts) < 5 or bits < SECRET_KEY_MIN_BITS:
        raise ConfigError(
            f"{name} is not random enough ({len(counts)} distinct characters, about {bits:.0f} bits); "
            "use e.g. python -c 'import secrets; print(secrets.token_urlsafe(50))'"
        )
    return value


def fernet_keys(name: str, keys: list[str]) -> list[str]:
    """`keys` if every one is a valid Fernet key; raise ConfigError naming the bad one's position."""
    from cryptography.fernet import Fernet

    if not keys:
        raise ConfigError(f"{name} must list at least one Fernet key")
    for index, key in enumerate(keys):
        try:
            Fernet(key)
        except (ValueError, TypeError):
            # The key is never echoed: this message ends up in logs.
            raise ConfigError(
                f"{name}: key #{index} is not a valid Fernet key (32 url-safe base64-encoded bytes; "
                "python -c 'from cryptography.fernet import Fernet; print(Fernet.generate_key()"
                ".decode())')"
            ) from None
    return keys


_LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def public_url(name: str, value: str, *, production: bool) -> str:
    """`value` without its trailing slash if it is a base URL the platform may publish.

    Such a URL goes to other parties (the `iss` providers fetch keys from, the OAuth callback
    registered with authorization servers, links in webhooks), so a wrong one fails far from here.
    In production it must be https; a loopback host is taken only over http, for trying production
    mode on one machine (README), and only when set explicitly (no default reaches this check).
    """
    from urllib.parse import urlsplit

    parts = urlsplit(value.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"{name} must be an absolute http(s) URL such as https://agents.example.com, got {value!r}"
        )
    if parts.username or parts.password:
        # Not echoed: this message ends up in logs.
        raise ConfigError(f"{name} must be a base URL with no credentials, query or fragment")
    if parts.query or parts.fragment:
        raise ConfigError(f"{name} must be a base URL with no credentials, query or fragment, got {value!r}")
    if production and parts.scheme != "https" and parts.hostname not in _LOOPBACK_HOSTS:
        raise ConfigError(f"{name} must use https in production, got {value!r}")
    return value.strip().rstrip("/")
