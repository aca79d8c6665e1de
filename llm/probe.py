"""Probe an endpoint: a short, bounded conversation that says which settings its server needs.

`manage.py probe_endpoint NAME` and `manage.py apply FILE --probe` run it against the real
server, with the endpoint's own settings, outside any transaction, and store the result on the
endpoint (`ModelEndpoint.probe`, shown in the admin):

    check         what is asked of the server                       failure names
    tools         the model is offered one tool and calls it        compat.tool_choice: auto, or the
                                                                    server's tool-call chat format
    tool_result   the tool's result reaches the model: it repeats    compat.tool_results: user (tried,
                  a nonce that exists only in the result, and the    and said when it works)
                  prompt grows with the result's size
    output_limit  asked for 400 numbers with an output limit of 16  stream: true (the platform cuts a
                  and tools offered, no more than 16 tokens come     server that ignores the limit)
    usage         the server reports the tokens it used             compat.stream_usage: include
    caching       the same prefix sent again reads from the cache   none: informational (cached-input
                                                                    prices then never apply)

At most 8 calls, each with a small output limit and the endpoint's timeouts. A check that fails
says the setting to change and, where the probe could try it, whether that setting worked. Every
check but `caching` must pass for the probe to pass. No run, budget or quota is touched: the
probe is an operator's test of the server, charged to nobody.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
from dataclasses import dataclass
from typing import Any

from django.utils import timezone

from llm.compat import Compat
from llm.models import ModelEndpoint
from llm.types import Message, ModelReply, ModelRequest, ProviderError, ToolCall, ToolSpec
from tenants.crypto import redact

TOOL = ToolSpec(
    "lookup_record",
    "Look a record up by its id and return it.",
    {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]},
)
INSTRUCTIONS = (
    "You are an assistant that uses tools. When asked to look a record up, call the lookup_record tool. "
    "Answer briefly."
)
ASK = "Look up record R-1 with the lookup_record tool, then reply with the value of the check field of its result."
COUNT = "Write the numbers from 1 to 400, separated by spaces, and nothing else."
ANSWER_TOKENS = 128  # the tool call and the nonce fit; a model that rambles is cut here
LIMIT_TOKENS = 16  # what the output_limit check asks for
PADDING_CHARS = 2_000  # added to the result to see the prompt grow (about 500 tokens)
GROWTH_TOKENS = 200  # a prompt that grew less than this did not carry the padded result


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    setting: str = ""  # the setting to change, when one would help
    required: bool = True

    def line(self) -> str:
        mark = "ok  " if self.ok else ("FAIL" if self.required else "note")
        return f"{mark} {self.name}: {self.detail}" + (f" -> {self.setting}" if self.setting else "")


@dataclass(frozen=True)
class ProbeResult:
    endpoint: str
    checks: tuple[Check, ...]
    calls: int

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks if check.required)

    def as_json(self) -> dict[str, Any]:
        return {
            "at": timezone.now().isoformat(),
            "ok": self.ok,
            "calls": self.calls,
            "checks": [dataclasses.asdict(check) for check in self.checks],
        }

    def render(self) -> str:
        head = f"probe of {self.endpoint}: {'passed' if self.ok else 'FAILED'} ({self.calls} calls)"
        return "\n".join([head, *(f"  {check.line()}" for check in self.checks)])


class _Session:
    """The probe's calls to one endpoint, with its settings or one changed, counted."""

    def __init__(self, endpoint: ModelEndpoint) -> None:
        self.endpoint = endpoint
        self.api_key = endpoint.secret.reveal() if endpoint.secret is not None else None
        self.calls = 0

    def provider(self, **changes: str):
        # Built here, not taken from the gateway's cache: the probe tries settings the endpoint
        # does not have yet.
        compat = Compat.of({**(self.endpoint.compat or {}), **changes})
        if self.endpoint.kind == ModelEndpoint.Kind.OPENAI:
            from llm.providers.openai import OpenAIProvider  # as in llm.gateway._provider: per provider

            return OpenAIProvider(
                self.endpoint.base_url,
                self.api_key,
                self.endpoint.model,
                send_cache_key=self.endpoint.send_cache_key,
                compat=compat,
                sampling=self.endpoint.sampling,
                stream=self.endpoint.stream,
            )
        from llm.providers.anthropic import AnthropicProvider  # as in llm.gateway._provider: per provider

        return AnthropicProvider(
            self.endpoint.base_url,
            self.api_key,
            self.endpoint.model,
            compat=compat,
            sampling=self.endpoint.sampling,
            stream=self.endpoint.stream,
        )

    def call(self, messages: list[Message], *, limit: int, **changes: str) -> ModelReply | str:
        """The reply, or the error as text (the key redacted)."""
        provider = self.provider(**changes)
        request = ModelRequest(
            model=self.endpoint.model,
            instructions=INSTRUCTIONS,
            messages=messages,
            tools=[TOOL],
            max_output_tokens=limit,
            timeout_seconds=self.endpoint.timeout_seconds,
            first_token_timeout_seconds=self.endpoint.first_token_timeout_seconds,
        )
        self.calls += 1
        try:
            return provider.complete(request)
        except ProviderError as exc:
            return redact(str(exc), [self.api_key] if self.api_key else [])
        finally:
            provider.close()


def probe(endpoint: ModelEndpoint, *, store: bool = True) -> ProbeResult:
    """Run the checks against the endpoint's server; store the result on the endpoint."""
    if endpoint.kind == ModelEndpoint.Kind.SCRIPTED:
        raise ValueError("a scripted endpoint has no server to probe")
    session = _Session(endpoint)
    compat = Compat.of(endpoint.compat)
    checks: list[Check] = []
    replies: list[ModelReply] = []

    first = session.call([Message("user", ASK)], limit=ANSWER_TOKENS)
    tools, call = _tools_check(session, compat, first, replies)
    checks.append(tools)
    checks.append(_result_check(session, compat, call, replies))
    checks.append(_limit_check(session, endpoint, replies))
    checks.append(_usage_check(endpoint, compat, replies))
    checks.append(_caching_check(session, replies))
    result = ProbeResult(endpoint.name, tuple(checks), session.calls)
    if store:
        ModelEndpoint.objects.filter(pk=endpoint.pk).update(probe=result.as_json())
        endpoint.probe = result.as_json()
    return result


# A refused call's error ends with the setting that adapts the request (llm.compat.refusal_hint).
_SETTING = re.compile(r"\bset ((?:compat\.\w+|stream|send_cache_key): [\w-]+)")


def _failed(name: str, error: str) -> Check:
    """A check whose call failed, with the setting the refusal named lifted into the check (so the
    report's line and the admin say what to change), or none when the error names none."""
    named = _SETTING.findall(error)
    return Check(name, False, f"the call failed: {error}", f"set {named[-1]}" if named else "")


def _tools_check(
    session: _Session, compat: Compat, first: ModelReply | str, replies: list[ModelReply]
) -> tuple[Check, ToolCall]:
    # When the model calls no tool, the next check still needs a call to answer: the probe's own.
    made_up = ToolCall(id="call_probe_1", name=TOOL.name, arguments={"id": "R-1"})
    if isinstance(first, str):
        return _failed("tools", first), made_up
    replies.append(first)
    called = next((c for c in first.tool_calls if c.name == TOOL.name), None)
    if called is not None:
        return Check("tools", True, f"the model called {TOOL.name} with {called.arguments}"), called
    detail = f"the model did not call the offered tool (it answered {first.text[:120]!r})"
    if session.endpoint.kind == ModelEndpoint.Kind.OPENAI and compat.tool_choice == "omit":
        again = session.call([Message("user", ASK)], limit=ANSWER_TOKENS, tool_choice="auto")
        if isinstance(again, ModelReply) and any(c.name == TOOL.name for c in again.tool_calls):
            return Check(
                "tools", False, detail + "; with tool_choice: auto it did", "set compat.tool_choice: auto"
            ), (next(c for c in again.tool_calls if c.name == TOOL.name))
    return (
        Check(
            "tools",
            False,
            detail,
            "the server's chat format must render tools (llama.cpp: --chat_format chatml-function-calling "
            "or --jinja; vLLM: --enable-auto-tool-choice --tool-call-parser; see docs/self-hosted.md)",
        ),
        made_up,
    )


def _result_check(session: _Session, compat: Compat, call: ToolCall, replies: list[ModelReply]) -> Check:
    nonce = f"nonce-{secrets.token_hex(4)}"

    def conversation(padding: int) -> list[Message]:
        result = (
            f'{{"id": "R-1", "check": "{nonce}"'
            + (f', "notes": "{"x " * (padding // 2)}"' if padding else "")
            + "}"
        )
        return [
            Message("user", ASK),
            Message("assistant", "", tool_calls=[call]),
            Message("tool", result, tool_call_id=call.id),
        ]

    def attempt(**changes: str) -> tuple[bool, int | None, str]:
        """(nonce repeated, prompt growth in tokens if usage says, the error if a call failed)"""
        small = session.call(conversation(0), limit=ANSWER_TOKENS, **changes)
        if isinstance(small, str):
            return False, None, small
        replies.append(small)
        large = session.call(conversation(PADDING_CHARS), limit=ANSWER_TOKENS, **changes)
        if isinstance(large, str):
            return nonce in small.text, None, large
        replies.append(large)
        measured = small.usage.counted_by == "server" and large.usage.counted_by == "server"
        growth = large.usage.total_input - small.usage.total_input if measured else None
        return nonce in small.text or nonce in large.text, growth, ""

    def reached(repeated: bool, growth: int | None) -> bool:
        return repeated and (growth is None or growth >= GROWTH_TOKENS)

    def said(repeated: bool, growth: int | None) -> str:
        text = (
            "the model repeated the nonce from the result"
            if repeated
            else "the model did not repeat the nonce"
        )
        if growth is not None:
            text += f"; the prompt grew {growth} tokens with {PADDING_CHARS} more characters of result"
        return text

    repeated, growth, error = attempt()
    if error:
        return _failed("tool_result", error)
    if reached(repeated, growth):
        return Check("tool_result", True, said(repeated, growth))
    detail = said(repeated, growth)
    if compat.tool_results == "tool":
        user_repeated, user_growth, user_error = attempt(tool_results="user")
        if not user_error and reached(user_repeated, user_growth):
            return Check(
                "tool_result",
                False,
                f"{detail}; with tool_results: user, {said(user_repeated, user_growth)}",
                "set compat.tool_results: user",
            )
        detail += f"; with tool_results: user, {user_error or said(user_repeated, user_growth)}"
    return Check(
        "tool_result",
        False,
        detail,
        "the tool result does not reach the model: check the server's chat format, or the model is too small "
        "to answer from it",
    )


def _limit_check(session: _Session, endpoint: ModelEndpoint, replies: list[ModelReply]) -> Check:
    reply = session.call([Message("user", COUNT)], limit=LIMIT_TOKENS)
    if isinstance(reply, str):
        return _failed("output_limit", reply)
    replies.append(reply)
    if reply.stop_reason == "cut_at_output_limit":
        return Check(
            "output_limit",
            True,
            f"the server went on past {LIMIT_TOKENS} tokens; the platform stopped reading at the limit",
        )
    if reply.usage.output_tokens <= LIMIT_TOKENS + 2:
        return Check("output_limit", True, f"{reply.usage.output_tokens} tokens of {LIMIT_TOKENS} allowed")
    setting = "set stream: true (the platform then cuts the answer at the limit)"
    if not endpoint.stream and endpoint.kind == ModelEndpoint.Kind.OPENAI:
        compat = Compat.of(endpoint.compat)
        if compat.max_tokens_field == "max_completion_tokens":
            setting += ", or compat.max_tokens_field: max_tokens if the server honours only that"
    return Check(
        "output_limit",
        False,
        f"the server answered {reply.usage.output_tokens} tokens against a limit of {LIMIT_TOKENS}",
        setting,
    )


def _usage_check(endpoint: ModelEndpoint, compat: Compat, replies: list[ModelReply]) -> Check:
    if not replies:
        return Check("usage", False, "no call answered")
    reported = [r for r in replies if r.usage.counted_by == "server" and r.usage.total_input > 0]
    if reported:
        usage = reported[0].usage
        return Check(
            "usage",
            True,
            f"the server reports usage ({usage.total_input} input, {usage.output_tokens} output tokens)",
        )
    setting = ""
    if endpoint.kind == ModelEndpoint.Kind.OPENAI and endpoint.stream and compat.stream_usage == "omit":
        setting = "set compat.stream_usage: include"
    return Check(
        "usage",
        False,
        "the server reported no usage: costs are the platform's own count (estimated input, output as read)",
        setting,
    )


def _caching_check(session: _Session, replies: list[ModelReply]) -> Check:
    again = session.call([Message("user", ASK)], limit=ANSWER_TOKENS)
    if isinstance(again, str):
        return dataclasses.replace(_failed("caching", again), required=False)
    replies.append(again)
    cached = max(r.usage.cached_input_tokens for r in replies)
    if cached:
        return Check("caching", True, f"the server reports cached input ({cached} tokens)", required=False)
    return Check(
        "caching",
        False,
        "the server reports no cached input tokens: prices.cached_input never applies",
        required=False,
    )


def probe_lines(stored: dict) -> list[str]:
    """A stored probe (ModelEndpoint.probe) as lines for the admin and the run page; [] never probed."""
    if not stored:
        return []
    head = (
        f"{'passed' if stored.get('ok') else 'FAILED'} at {stored.get('at', '?')[:19].replace('T', ' ')} UTC"
    )
    return [head] + [Check(**check).line() for check in stored.get("checks", [])]


def failed_probe(stored: dict) -> str:
    """One sentence for a run on an endpoint whose last probe failed; "" when it passed or never ran."""
    if not stored or stored.get("ok", True):
        return ""
    failing = [c for c in stored.get("checks", []) if c.get("required", True) and not c.get("ok")]
    settings = "; ".join(c["setting"] for c in failing if c.get("setting"))
    return f"the endpoint's last probe failed ({', '.join(c['name'] for c in failing)})" + (
        f": {settings}" if settings else ""
    )
