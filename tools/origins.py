"""Where a secret may go: the origin (scheme, host, port) of the server it was configured for.

A tool server's credential is bound to the origin of its configured URL. Every request that
carries it (an HTTP tool's POST, its status lookup, each request of an MCP session) must go to
that origin; anything else is refused before a byte is sent. Egress lists (a tenant's allowed
hosts, checked by `manage.py apply`) use the same parsing.
"""

from __future__ import annotations

from urllib.parse import urlsplit

DEFAULT_PORTS = {"http": 80, "https": 443}


class OriginError(ValueError):
    """A URL with no usable origin (not http(s), no host, a bad port)."""


def origin(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of an http(s) URL, lower-cased, with the default port filled in."""
    try:
        parts = urlsplit(url.strip())
        scheme = parts.scheme.lower()
        host = (parts.hostname or "").lower()
        port = parts.port
    except ValueError:
        raise OriginError(f"not a valid URL: {url!r}") from None
    if scheme not in DEFAULT_PORTS or not host:
        raise OriginError(f"not an http(s) URL with a host: {url!r}")
    return scheme, host, port or DEFAULT_PORTS[scheme]


def origin_text(url: str) -> str:
    scheme, host, port = origin(url)
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}:{port}"


def same_origin(url: str, configured: str) -> bool:
    try:
        return origin(url) == origin(configured)
    except OriginError:
        return False


def host_allowed(url: str, allowed: list[str]) -> bool:
    """True if the URL's host (and port) matches one of `allowed`.

    An entry is `host`, `host:port` or `*.domain` (any subdomain of domain, not domain itself);
    an entry without a port allows every port.
    """
    _, host, port = origin(url)
    for entry in allowed:
        pattern, wanted_port = split_host_port(entry)
        if wanted_port is not None and wanted_port != port:
            continue
        if pattern.startswith("*."):
            if host.endswith(pattern[1:]) and host != pattern[2:]:
                return True
        elif host == pattern:
            return True
    return False


def split_host_port(entry: str) -> tuple[str, int | None]:
    """`host[:port]` (IPv6 as `[::1]:8080`) lower-cased; raises OriginError when malformed."""
    text = entry.strip().lower()
    if not text or any(c in text for c in "/?#@ "):
        raise OriginError(f"bad host {entry!r}: give host, host:port or *.domain")
    host, port = text, None
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise OriginError(f"bad host {entry!r}")
        host, rest = text[1:end], text[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise OriginError(f"bad host {entry!r}")
            port = _port(rest[1:], entry)
    elif text.count(":") == 1:
        host, _, raw = text.partition(":")
        port = _port(raw, entry)
    if not host or any(c in host for c in "/?#@ ") or "*" in host.removeprefix("*."):
        raise OriginError(f"bad host {entry!r}: give host, host:port or *.domain")
    return host, port


def _port(raw: str, entry: str) -> int:
    if not raw.isascii() or not raw.isdigit() or not 0 < int(raw) < 65536:
        raise OriginError(f"bad port in {entry!r}")
    return int(raw)
