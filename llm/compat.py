"""How an OpenAI-compatible server differs from OpenAI's API: the per-endpoint `compat` settings.

The servers banks run themselves (vLLM, llama.cpp's server and llama-cpp-python, Ollama, LiteLLM's
proxy, Azure OpenAI) accept most of the Chat Completions shape but not all of it, and each refuses
a different part. Every difference the platform knows is a setting here, with the default that
OpenAI and most servers accept:

    max_tokens_field   max_completion_tokens | max_tokens    the output limit's name
    tool_call_content  null | empty_string | omit            `content` of an assistant tool-call turn
    tool_choice        omit | auto                           send "tool_choice": "auto" with tools
    system_message     system | always | in_user             how the instructions go out

`system`: a system message when the version has instructions. `always`: a system message even when
it has none (some tool-call templates need one). `in_user`: the instructions lead the first user
message, for chat templates with no system role (Gemma's).

A server that refuses a request shape answers 4xx, or 5xx with a body that says validation
(llm/providers/http.py classifies both as refused, not retried). `refusal_hint` reads that answer
with the request that caused it and names the setting to change, so a supervisor reading the failed
run knows what to set instead of reading "failed 5 times in a row".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SETTINGS: dict[str, tuple[str, ...]] = {
    "max_tokens_field": ("max_completion_tokens", "max_tokens"),
    "tool_call_content": ("null", "empty_string", "omit"),
    "tool_choice": ("omit", "auto"),
    "system_message": ("system", "always", "in_user"),
}


@dataclass(frozen=True)
class Compat:
    max_tokens_field: str = "max_completion_tokens"
    tool_call_content: str = "null"
    tool_choice: str = "omit"
    system_message: str = "system"

    @classmethod
    def of(cls, settings: dict | None) -> Compat:
        """The settings as stored on the endpoint (validated when the configuration was read)."""
        known = {key: value for key, value in (settings or {}).items() if key in SETTINGS}
        return cls(**known)


def problems(value: Any) -> list[tuple[str, str]]:
    """(key, message) for each bad part of a `compat` mapping; empty when it is valid."""
    if not isinstance(value, dict):
        return [("", "must be a mapping")]
    found = []
    for key, given in value.items():
        if key not in SETTINGS:
            found.append((f".{key}", f"unknown setting; one of {', '.join(SETTINGS)}"))
        elif given not in SETTINGS[key]:
            found.append((f".{key}", f"must be one of {', '.join(SETTINGS[key])}"))
    return found


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
