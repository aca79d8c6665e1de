"""How a model server differs from the API its wire was written for: the per-endpoint `compat`
settings, and its sampling defaults (`sampling`).

The servers banks run themselves (vLLM, llama.cpp's server and llama-cpp-python, Ollama, TGI,
LiteLLM's proxy, Azure OpenAI) accept most of the Chat Completions or Messages shape but not all
of it, and each refuses, or silently drops, a different part. Every difference the platform knows
is a setting here, per endpoint kind, with the default that OpenAI's and Anthropic's own APIs
accept:

    openai
    max_tokens_field   max_completion_tokens | max_tokens    the output limit's name
    tool_call_content  null | empty_string | omit            `content` of an assistant tool-call turn
    tool_choice        omit | auto                           send "tool_choice": "auto" with tools
    system_message     system | always | in_user             how the instructions go out
    stream_usage       include | omit                        ask for usage in a stream (stream_options)
    anthropic
    prompt_cache       blocks | none                         cache_control breakpoints, or none at all
    system             blocks | string                       `system` as text blocks or a plain string
    context_editing    none | clear_tool_uses                the server clears old tool results on
                                                             request (Anthropic's context editing beta)
    both
    tool_results       tool | user                           how the tools' results go back

`system`: a system message when the version has instructions. `always`: a system message even when
it has none (some tool-call templates need one). `in_user`: the instructions lead the first user
message, for chat templates with no system role (Gemma's).

`tool_results: user`: the calls and their results travel as plain conversation text, an assistant
turn that names each call and a user turn with each result, for servers whose chat template drops
`role: tool` messages (llama-cpp-python's `chatml-function-calling` does: the model never sees a
result and cannot answer from it), or a proxy that turns Anthropic's tool_result blocks into them.

`prompt_cache: none` and `system: string`: for servers that speak the Messages wire but not its
cache blocks (LiteLLM's proxy in front of an OpenAI-compatible server passes `cache_control`
blocks on as list content, which that server refuses).

An unknown setting, or one of the other kind's, is an error where the configuration is read
(`problems`), never ignored.

A server that refuses a request shape answers 4xx, or 5xx with a body that says validation
(llm/providers/http.py classifies both as refused, not retried). `refusal_hint` reads that answer
with the request that caused it and names the setting to change, so a supervisor reading the failed
run knows what to set instead of reading "failed 5 times in a row".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from llm.types import Message

BOTH: dict[str, tuple[str, ...]] = {"tool_results": ("tool", "user")}
SETTINGS_BY_KIND: dict[str, dict[str, tuple[str, ...]]] = {
    "openai": {
        "max_tokens_field": ("max_completion_tokens", "max_tokens"),
        "tool_call_content": ("null", "empty_string", "omit"),
        "tool_choice": ("omit", "auto"),
        "system_message": ("system", "always", "in_user"),
        "stream_usage": ("include", "omit"),
        **BOTH,
    },
    "anthropic": {
        "prompt_cache": ("blocks", "none"),
        "system": ("blocks", "string"),
        "context_editing": ("none", "clear_tool_uses"),
        **BOTH,
    },
}
# The OpenAI wire's settings: what a refusal on that wire is told to change.
SETTINGS = SETTINGS_BY_KIND["openai"]
# How a refusal names the `stream` field (not "upstream", which proxies say of any failure).
_STREAM_WORDS = ("streaming", "'stream'", '"stream"', "stream:", "stream is", "stream must", "stream not")
# Sampling defaults an endpoint may set, with the range each wire accepts.
SAMPLING_RANGES: dict[str, dict[str, tuple[float, float]]] = {
    "openai": {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0)},
    "anthropic": {"temperature": (0.0, 1.0), "top_p": (0.0, 1.0)},
}


@dataclass(frozen=True)
class Compat:
    max_tokens_field: str = "max_completion_tokens"
    tool_call_content: str = "null"
    tool_choice: str = "omit"
    system_message: str = "system"
    stream_usage: str = "include"
    prompt_cache: str = "blocks"
    system: str = "blocks"
    context_editing: str = "none"
    tool_results: str = "tool"

    @classmethod
    def of(cls, settings: dict | None) -> Compat:
        """The settings as stored on the endpoint (validated when the configuration was read)."""
        known = {key: value for key, value in (settings or {}).items() if key in cls.__dataclass_fields__}
        return cls(**known)


def problems(value: Any, kind: str = "openai") -> list[tuple[str, str]]:
    """(key, message) for each bad part of a `compat` mapping for an endpoint of `kind`; empty
    when it is valid."""
    if not isinstance(value, dict):
        return [("", "must be a mapping")]
    settings = SETTINGS_BY_KIND.get(kind)
    if settings is None:
        return [("", f"only for openai and anthropic endpoints, not {kind}")] if value else []
    found = []
    for key, given in value.items():
        other = next((k for k, table in SETTINGS_BY_KIND.items() if k != kind and key in table), None)
        if key not in settings and other is not None:
            found.append((f".{key}", f"only for {other} endpoints; {kind} takes {', '.join(settings)}"))
        elif key not in settings:
            found.append((f".{key}", f"unknown setting; one of {', '.join(settings)}"))
        elif given not in settings[key]:
            found.append((f".{key}", f"must be one of {', '.join(settings[key])}"))
    return found


def sampling_problems(value: Any, kind: str = "openai") -> list[tuple[str, str]]:
    """(key, message) for each bad part of a `sampling` mapping for an endpoint of `kind`."""
    if not isinstance(value, dict):
        return [("", "must be a mapping")]
    ranges = SAMPLING_RANGES.get(kind)
    if ranges is None:
        return [("", f"only for openai and anthropic endpoints, not {kind}")] if value else []
    found = []
    for key, given in value.items():
        if key not in ranges:
            found.append((f".{key}", f"unknown setting; one of {', '.join(ranges)}"))
            continue
        low, high = ranges[key]
        number = isinstance(given, (int, float)) and not isinstance(given, bool)
        if not number or not math.isfinite(given) or not low <= given <= high:
            found.append((f".{key}", f"must be a number from {low:g} to {high:g}"))
    return found


def tool_calls_text(message: Message) -> str:
    """An assistant turn's calls written out: `tool_results: user` on both wires."""
    lines = [message.content] if message.content else []
    lines += [
        f"[called tool {call.name} (call {call.id}) with {json.dumps(call.arguments, sort_keys=True)}]"
        for call in message.tool_calls
    ]
    return "\n".join(lines)


def tool_result_text(message: Message, name: str) -> str:
    """A tool's result as a user turn: `tool_results: user` on both wires."""
    marked = not message.is_error or message.content.startswith("ERROR:")
    content = message.content if marked else f"ERROR: {message.content}"
    return f"[result of tool {name or 'call'} (call {message.tool_call_id})]\n{content}"


def refusal_hint(detail: str, body: dict[str, Any], compat: Compat) -> str:
    """The setting to change for a refused request, read from the server's answer and what was
    sent; a pointer to all of them when the answer names none."""
    text = detail.lower()
    sent = set(body)

    def mentions(*words: str) -> bool:
        return any(word in text for word in words)

    if mentions("context length", "context window", "too large", "maximum context", "exceeds"):
        # A size, not a shape: the field was understood; its value or the prompt was too big.
        return (
            "the request is larger than the server allows: lower limits.max_output_tokens or shorten the run"
        )
    if "max_completion_tokens" in sent and mentions("max_completion_tokens"):
        return "the server refused max_completion_tokens: set compat.max_tokens_field: max_tokens"
    if "max_tokens" in sent and mentions("max_tokens"):
        return "the server refused max_tokens: set compat.max_tokens_field: max_completion_tokens"
    if "tool_choice" in sent and mentions("tool_choice"):
        return "the server refused tool_choice: set compat.tool_choice: omit"
    if "prompt_cache_key" in sent and mentions("prompt_cache_key"):
        return "the server refused prompt_cache_key: set send_cache_key: false"
    if "stream_options" in sent and mentions("stream_options", "include_usage"):
        return "the server refused stream_options: set compat.stream_usage: omit"
    if "stream" in sent and mentions(*_STREAM_WORDS):
        return "the server refused a streamed answer: set stream: false"
    messages = body.get("messages") or []
    # Before the system rule: a validator's answer to one bad message lists every role it tried.
    tool_turns = [m for m in messages if m.get("role") == "assistant" and m.get("tool_calls")]
    if tool_turns and mentions("content"):
        if compat.tool_call_content == "null":
            return "the server refused content: null on a tool-call turn: set compat.tool_call_content: empty_string"
        if compat.tool_call_content == "empty_string":
            return 'the server refused content: "" on a tool-call turn: set compat.tool_call_content: omit'
        return "the server wants content on a tool-call turn: set compat.tool_call_content: empty_string"
    if mentions("system role", "system message", "role 'system'", 'role "system"', "system prompt"):
        if any(m.get("role") == "system" for m in messages):
            return "the server refused the system message: set compat.system_message: in_user"
        return "the server wants a system message: set compat.system_message: always"
    return (
        "the server refused this request shape; the endpoint's compat settings adapt it ("
        + ", ".join(f"{key}: {'|'.join(values)}" for key, values in SETTINGS.items())
        + "; see docs/configuration.md)"
    )


def anthropic_refusal_hint(detail: str, body: dict[str, Any]) -> str:
    """The setting to change for a request refused on the Messages wire (a proxy or a server that
    speaks it without all of it)."""
    text = detail.lower()
    if any(word in text for word in ("context length", "context window", "too large", "maximum context")):
        return (
            "the request is larger than the server allows: lower limits.max_output_tokens or shorten the run"
        )
    blocks = isinstance(body.get("system"), list)
    if "cache_control" in text:
        return "the server refused cache_control blocks: set compat.prompt_cache: none"
    if blocks and "system" in text:
        return "the server refused system as blocks: set compat.system: string"
    if "stream" in body and any(word in text for word in _STREAM_WORDS):
        return "the server refused a streamed answer: set stream: false"
    if blocks or "cache_control" in str(body):
        # LiteLLM's proxy passes list content on to the server behind it, which may refuse it in
        # its own words (a 500 "can only concatenate str (not "list") to str").
        return (
            "the server refused this request shape; servers behind a proxy often refuse list content: "
            "set compat.system: string and compat.prompt_cache: none (see docs/configuration.md)"
        )
    return (
        "the server refused this request shape; the endpoint's compat settings adapt it ("
        + ", ".join(f"{key}: {'|'.join(values)}" for key, values in SETTINGS_BY_KIND["anthropic"].items())
        + "; see docs/configuration.md)"
    )
