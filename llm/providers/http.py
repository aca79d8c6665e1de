"""HTTP plumbing shared by the provider clients: one POST, error classification.

No retries happen here on purpose: the caller owns the retry/budget policy and needs to
know whether a failed attempt may have been charged (ProviderError.sent).
"""

from __future__ import annotations

import datetime
import email.utils
import json
import re
import time
from typing import Any

import httpx

from core.cookies import no_cookies
from llm.types import ProviderError

# Generous pool: one provider instance is shared by many concurrent agent runs. An idle connection
# is dropped after 1 s, well before a server closes it: uvicorn (vLLM, LiteLLM) and Node close idle
# connections after 5 s, httpx's own default, and a call sent on a connection the server is closing
# fails after it was sent: a lost reply, a held charge and a second call, caused by the platform.
_LIMITS = httpx.Limits(max_connections=256, max_keepalive_connections=64, keepalive_expiry=1.0)
# The provider's answer is what a supervisor reads on a failed run: kept whole, up to a bound
# that only a proxy's HTML error page would reach.
_MAX_ERROR_DETAIL = 8_000
# A 5xx whose body says the request itself is wrong (self-hosted servers answer a request shape
# they do not support so): refused, not unavailable, so it is not retried.
_REFUSAL = re.compile(
    r"validat|invalid|unsupported|not supported|unrecognized|unknown (field|parameter)", re.I
)

_TAGS = re.compile(r"<(script|style)\b.*?</\1>|<[^>]+>", re.I | re.S)


def make_client() -> httpx.Client:
    """A thread-safe client with transport-level retries disabled, shared by every run calling
    the endpoint: it keeps no cookie a provider sets (core/cookies.py)."""
    return httpx.Client(transport=httpx.HTTPTransport(retries=0, limits=_LIMITS), cookies=no_cookies())


def request_timeout(seconds: float) -> httpx.Timeout:
    """Overall budget per phase, but fail fast when the host is unreachable."""
    return httpx.Timeout(seconds, connect=min(5.0, seconds))


def post_json(
    client: httpx.Client,
    url: str,
    *,
    headers: dict[str, str],
    body: dict[str, Any],
    timeout_seconds: float,
    provider: str,
    secret: str | None,
) -> dict[str, Any]:
    """POST a JSON body and return the decoded JSON reply, or raise ProviderError."""
    try:
        response = client.post(url, json=body, headers=headers, timeout=request_timeout(timeout_seconds))
    except httpx.TransportError as exc:
        raise transport_error(exc, provider=provider, secret=secret) from None
    if response.status_code >= 300:
        raise status_error(response, provider=provider, secret=secret)
    try:
        data = response.json()
    except ValueError:
        # A 2xx that is not JSON is most likely a proxy hiccup; the call may still be billed.
        raise ProviderError(
            f"{provider}: HTTP {response.status_code} with a non-JSON body",
            retryable=True,
            sent=True,
            status=response.status_code,
        ) from None
    if not isinstance(data, dict):
        raise ProviderError(
            f"{provider}: reply is not a JSON object", retryable=False, sent=True, status=response.status_code
        )
    return data


def transport_error(exc: httpx.TransportError, *, provider: str, secret: str | None) -> ProviderError:
    """Classify a transport failure by whether the request may have reached the server."""
    # ConnectTimeout is a TimeoutException, so it must be checked before the timeout branch.
    never_sent = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
    detail = redact(str(exc) or "no detail", secret)
    return ProviderError(
        f"{provider}: {type(exc).__name__}: {detail}",
        retryable=True,
        sent=not never_sent,
        # A host that does not accept the connection in time is down, not slow: server_error.
        timed_out=isinstance(exc, httpx.TimeoutException) and not never_sent,
    )


def status_error(response: httpx.Response, *, provider: str, secret: str | None) -> ProviderError:
    status = response.status_code
    detail = redact(error_detail(response), secret)
    # 529 is Anthropic's "overloaded"; 408 is a server-side request timeout.
    retryable = status == 429 or status == 408 or (status >= 500 and not _REFUSAL.search(detail))
    retry_after = parse_retry_after(response.headers) if retryable else None
    verdict = "unavailable" if retryable else "refused this request"
    return ProviderError(
        f"{provider}: HTTP {status} (the provider {verdict}): {detail}",
        retryable=retryable,
        sent=True,
        status=status,
        retry_after=retry_after,
    )


def error_detail(response: httpx.Response) -> str:
    """The provider's error message, from the shapes servers answer with: {"error": {"message"}}
    (OpenAI, Anthropic, llama.cpp), {"error": "..."} (Ollama), {"message": ...} (vLLM),
    {"detail": ...} (FastAPI servers); else the body as text, an HTML page reduced to its words."""
    try:
        data = response.json()
    except ValueError:
        text = response.text
        if "<" in text and re.search(r"<(html|body|head|title|h1|p)\b", text, re.I):
            text = " ".join(_TAGS.sub(" ", text).split())
        return text.strip()[:_MAX_ERROR_DETAIL] or response.reason_phrase
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            kind = error.get("type")
            message = error["message"][:_MAX_ERROR_DETAIL]
            return f"{kind}: {message}" if kind else message
        for key in ("error", "message", "detail"):
            if isinstance(data.get(key), str):
                return data[key][:_MAX_ERROR_DETAIL]
    return json.dumps(data)[:_MAX_ERROR_DETAIL]


def parse_retry_after(headers: httpx.Headers, now: float | None = None) -> float | None:
    """Seconds to wait, from `retry-after-ms` (OpenAI) or `Retry-After` (seconds or HTTP date)."""
    millis = headers.get("retry-after-ms")
    if millis is not None:
        try:
            return max(0.0, float(millis) / 1000.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # "-0000" parses as naive; HTTP dates are always GMT
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def redact(text: str, secret: str | None) -> str:
    """Error bodies can echo the key back (e.g. "Incorrect API key provided: sk-...")."""
    if secret and len(secret) >= 4:
        text = text.replace(secret, "[redacted]")
    return text
