"""HTTP plumbing shared by the provider clients: one POST, one streamed POST, error classification.

No retries happen here on purpose: the caller owns the retry/budget policy and needs to
know whether a failed attempt may have been charged (ProviderError.sent).

A streamed answer (`stream_events`, server-sent events) is read under two clocks: the first
token must come within `first_token_seconds` (and no later silence may last longer), and the
whole answer within `timeout_seconds`. The caller may stop reading at any event (its output
limit): closing the generator closes the response, and an HTTP/1.1 connection whose answer was
not read to the end is closed rather than put back in the pool, which is how a server learns
that nobody is reading (llama.cpp's server and vLLM stop generating on it).
"""

from __future__ import annotations

import codecs
import datetime
import email.utils
import json
import re
import time
from collections.abc import Callable, Generator
from typing import Any, Protocol

import httpx

from core.cookies import no_cookies
from llm.types import ModelReply, ModelRequest, ProviderError

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


class StreamedReply(Protocol):
    """A wire's answer put together from its streamed events (each wire has its own)."""

    meter: OutputMeter

    def add(self, data: Any) -> None: ...

    def reply(self, request: ModelRequest, *, cut: bool) -> ModelReply: ...


def complete_call(
    client: httpx.Client,
    url: str,
    request: ModelRequest,
    *,
    headers: dict[str, str],
    body: dict[str, Any],
    stream: bool,
    provider: str,
    secret: str | None,
    parse_reply: Callable[[dict[str, Any]], ModelReply],
    streamed: Callable[[int], StreamedReply],
    is_token: Callable[[str, Any], bool],
    refusal_hint: Callable[[str], str],
) -> ModelReply:
    """One model call on either wire: one JSON answer (`parse_reply`), or a stream read into
    `streamed(limit)` until it ends or the call's output limit is reached (closing the generator
    closes the connection). A refused request (a non-retried 4xx/5xx other than auth and a wrong
    path) raises with `refusal_hint(detail)` appended: the same request would be refused again,
    so the message says which setting to change."""
    try:
        if stream:
            answer = _read_stream(
                client,
                url,
                request,
                headers=headers,
                body=body,
                provider=provider,
                secret=secret,
                streamed=streamed,
                is_token=is_token,
            )
        else:
            answer = post_json(
                client,
                url,
                headers=headers,
                body=body,
                timeout_seconds=request.timeout_seconds,
                provider=provider,
                secret=secret,
            )
    except ProviderError as exc:
        if exc.retryable or exc.status is None or exc.status < 300 or exc.status in (401, 403, 404):
            raise  # a 2xx that is no answer is the server's fault, not a setting to change
        raise ProviderError(
            f"{exc}; {refusal_hint(str(exc))}", retryable=False, sent=exc.sent, status=exc.status
        ) from None
    # Parsed outside the refusal handling, for the same reason.
    return parse_reply(answer) if isinstance(answer, dict) else answer


def _read_stream(
    client: httpx.Client,
    url: str,
    request: ModelRequest,
    *,
    headers: dict[str, str],
    body: dict[str, Any],
    provider: str,
    secret: str | None,
    streamed: Callable[[int], StreamedReply],
    is_token: Callable[[str, Any], bool],
) -> ModelReply | dict[str, Any]:
    """The streamed answer, or the one JSON body of a server that ignored `stream`."""
    answer = streamed(request.max_output_tokens)
    events = stream_events(
        client,
        url,
        headers=headers,
        body=body,
        timeout_seconds=request.timeout_seconds,
        first_token_seconds=request.first_token_timeout_seconds,
        provider=provider,
        secret=secret,
        is_token=is_token,
    )
    try:
        for name, data in events:
            if name == "whole":
                if not isinstance(data, dict):
                    raise ProviderError(
                        f"{provider}: reply is not a JSON object", retryable=False, sent=True, status=200
                    )
                return data
            answer.add(data)
            if answer.meter.reached:
                return answer.reply(request, cut=True)
    finally:
        events.close()
    return answer.reply(request, cut=False)


def stream_events(
    client: httpx.Client,
    url: str,
    *,
    headers: dict[str, str],
    body: dict[str, Any],
    timeout_seconds: float,
    first_token_seconds: float | None,
    provider: str,
    secret: str | None,
    is_token: Callable[[str, Any], bool],
) -> Generator[tuple[str, Any]]:
    """POST a JSON body asking for a stream and yield its events as (event name, decoded data);
    raise ProviderError for a refusal, a lost connection or a clock that ran out.

    `is_token(name, data)`: whether an event carries generated output, so the first-token clock
    stops (a stream's opening event, Anthropic's message_start, comes before any generation). A
    server that ignores `stream` and answers one JSON body yields ("whole", body)."""
    first = min(first_token_seconds or timeout_seconds, timeout_seconds)
    started = time.monotonic()
    deadline = started + timeout_seconds
    # The read timeout is the longest silence allowed: before the first token and after it.
    timeout = httpx.Timeout(timeout_seconds, connect=min(5.0, timeout_seconds), read=first)
    answered = False
    try:
        with client.stream("POST", url, json=body, headers=headers, timeout=timeout) as response:
            if response.status_code >= 300:
                response.read()
                raise status_error(response, provider=provider, secret=secret)
            if "text/event-stream" not in response.headers.get("content-type", ""):
                # A server that ignores `stream` answers with one JSON body: read it as such.
                response.read()
                try:
                    data = response.json()
                except ValueError:
                    raise ProviderError(
                        f"{provider}: HTTP {response.status_code} with a non-JSON body",
                        retryable=True,
                        sent=True,
                        status=response.status_code,
                    ) from None
                yield "whole", data
                return
            # Split into events here rather than by httpx's lines: a streamed answer is one event
            # per token, and this loop is most of the platform's own cost of reading it
            # (bench/streaming.py; docs/performance.md).
            text = codecs.getincrementaldecoder("utf-8")(errors="replace")
            buffer = ""
            for block in response.iter_bytes():
                now = time.monotonic()
                if now > deadline:
                    raise _clock_error(provider, f"no complete answer within {timeout_seconds:g}s")
                if not answered and now > started + first:
                    raise _clock_error(provider, f"no first token within {first:g}s")
                buffer += text.decode(block)
                if "\r" in buffer:
                    # Lines may end in CRLF (sse-starlette, under llama-cpp-python's server), LF or
                    # CR; a CR at the end may be half of a CRLF, so it waits for the next block.
                    held = buffer.endswith("\r")
                    buffer = (buffer[:-1] if held else buffer).replace("\r\n", "\n").replace("\r", "\n")
                    buffer += "\r" if held else ""
                if "\n\n" not in buffer:
                    continue
                *events, buffer = buffer.split("\n\n")
                for chunk in events:
                    name, raw = sse_event(chunk)
                    if raw is None:
                        continue  # comments only: servers send them to keep a connection open
                    if raw == "[DONE]":
                        return
                    decoded = _json(raw)
                    if decoded is _NOT_JSON:
                        raise ProviderError(
                            f"{provider}: a streamed event is not JSON: {redact(raw[:200], secret)}",
                            retryable=True,
                            sent=True,
                            status=response.status_code,
                        )
                    answered = answered or is_token(name, decoded)
                    yield name, decoded
    except httpx.ReadTimeout:
        waited = time.monotonic() - started
        if not answered:
            raise _clock_error(provider, f"no first token within {first:g}s") from None
        raise _clock_error(
            provider, f"the server went silent for {first:g}s mid-answer ({waited:.1f}s into the call)"
        ) from None
    except httpx.TransportError as exc:
        raise transport_error(exc, provider=provider, secret=secret) from None


_NOT_JSON = object()
_DECODER = json.JSONDecoder()


def _json(raw: str) -> Any:
    """json.loads without its wrapper's checks (a third of its cost on a token's event)."""
    try:
        value, end = _DECODER.raw_decode(raw)
    except ValueError:
        return _NOT_JSON
    return value if end == len(raw) or not raw[end:].strip() else _NOT_JSON


def sse_event(chunk: str) -> tuple[str, str | None]:
    """One server-sent event's name and data (its data lines joined; None if it has none)."""
    if chunk.startswith("data: ") and "\n" not in chunk:
        return "", chunk[6:].strip()  # the usual event (OpenAI's wire): one data line, no name
    name, data = "", []
    for line in chunk.split("\n"):
        if not line or line.startswith(":"):
            continue  # a comment
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "event":
            name = value
        elif field == "data":
            data.append(value)
    return name, "\n".join(data).strip() if data else None


def _clock_error(provider: str, what: str) -> ProviderError:
    return ProviderError(f"{provider}: timed out: {what}", retryable=True, sent=True, timed_out=True)


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


class OutputMeter:
    """The platform's own count of a streamed answer's output, to stop reading at the limit.

    Each piece of text or tool arguments a server streams is usually one token (llama.cpp's
    server, vLLM, TGI and OpenAI send one per event); a server that sends larger pieces is
    counted at one token per 4 characters, which over-counts rather than lets a runaway answer
    through. `reached` once the count is at the call's output limit.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.tokens = 0

    def add(self, piece: str) -> None:
        if piece:
            self.tokens += max(1, len(piece) // 4)

    @property
    def reached(self) -> bool:
        return self.tokens >= self.limit
