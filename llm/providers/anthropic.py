"""Anthropic Messages API client.

Cache breakpoints (at most 4, the API's limit): the last tool and the system block, so tools +
system form one prefix shared by every turn of every run with the same instructions and tools
(tools render before system); and two on the conversation, which moves on every turn: the last
block of the newest message, and the last block of the user turn before the newest assistant
turn, which is where the previous request's moving breakpoint sat. The API writes the prefix up
to a breakpoint and reads it back at a later breakpoint only at a block boundary it finds within
20 blocks before that breakpoint; pinning the previous request's end as well makes the read exact
however many blocks one turn adds (parallel tool calls), so each request reads what the previous
one wrote and writes only its new turn.
"""

from __future__ import annotations

from typing import Any

from llm.providers.http import make_client, post_json
from llm.types import Message, ModelReply, ModelRequest, ProviderError, ToolCall, ToolSpec, Usage

PROVIDER = "anthropic"
API_VERSION = "2023-06-01"
_EPHEMERAL = {"type": "ephemeral"}


class AnthropicProvider:
    def __init__(self, base_url: str, api_key: str | None, model: str):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._api_key = api_key
        self._client = make_client()

    def __repr__(self) -> str:  # keep the key out of logs and tracebacks
        return f"AnthropicProvider(base_url={self.base_url!r}, model={self.model!r})"

    def close(self) -> None:
        self._client.close()

    def complete(self, request: ModelRequest) -> ModelReply:
        data = post_json(
            self._client,
            f"{self.base_url}/v1/messages",
            headers=self._headers(),
            body=self.build_body(request),
            timeout_seconds=request.timeout_seconds,
            provider=PROVIDER,
            secret=self._api_key,
        )
        return parse_reply(data)

    def build_body(self, request: ModelRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            # The request may pin a model; otherwise the provider's configured one is used.
            "model": request.model or self.model,
            "max_tokens": request.max_output_tokens,
            "messages": mark_conversation(build_messages(request.messages)),
        }
        if request.instructions:  # the API rejects empty text blocks
            body["system"] = [{"type": "text", "text": request.instructions, "cache_control": _EPHEMERAL}]
        if request.tools:
            body["tools"] = build_tools(request.tools)
        return body

    def _headers(self) -> dict[str, str]:
        headers = {"anthropic-version": API_VERSION}
        if self._api_key:
            headers["x-api-key"] = self._api_key
        return headers


def build_tools(tools: list[ToolSpec]) -> list[dict[str, Any]]:
    wire: list[dict[str, Any]] = [
        {"name": tool.name, "description": tool.description, "input_schema": tool.input_schema}
        for tool in tools
    ]
    wire[-1]["cache_control"] = _EPHEMERAL
    return wire


def build_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Map turns to blocks, merging adjacent turns of the same wire role.

    Tool results travel as user turns, and the API wants every result for an assistant turn
    in the single user message that follows it (roles must alternate).
    """
    wire: list[dict[str, Any]] = []
    for message in messages:
        role = "assistant" if message.role == "assistant" else "user"
        blocks = message_blocks(message)
        if wire and wire[-1]["role"] == role:
            wire[-1]["content"].extend(blocks)
        else:
            wire.append({"role": role, "content": blocks})
    for turn in wire:
        turn["content"] = results_first(turn["content"])
    return wire


def mark_conversation(wire: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Put the moving breakpoints on the newest message and on the previous request's end."""
    marked = [len(wire) - 1]
    if len(wire) >= 3:
        marked.append(len(wire) - 3)  # the user turn before the newest assistant turn
    for index in marked:
        wire[index]["content"][-1]["cache_control"] = _EPHEMERAL
    return wire


def results_first(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # The API requires tool_result blocks to precede any text in a user message.
    results = [block for block in blocks if block["type"] == "tool_result"]
    others = [block for block in blocks if block["type"] != "tool_result"]
    return results + others


def message_blocks(message: Message) -> list[dict[str, Any]]:
    if message.role == "tool":
        block: dict[str, Any] = {
            "type": "tool_result",
            "tool_use_id": message.tool_call_id,
            "content": message.content,
        }
        if message.is_error:
            block["is_error"] = True
        return [block]
    if message.role not in ("user", "assistant"):
        raise ValueError(f"unknown message role {message.role!r}")
    blocks: list[dict[str, Any]] = []
    if message.content or not message.tool_calls:
        blocks.append({"type": "text", "text": message.content})
    blocks.extend(
        {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}
        for call in message.tool_calls
    )
    return blocks


def parse_reply(data: dict[str, Any]) -> ModelReply:
    try:
        blocks = data["content"]
        text = "".join(block["text"] for block in blocks if block.get("type") == "text")
        calls = [
            ToolCall(id=block["id"], name=block["name"], arguments=parse_input(block.get("input")))
            for block in blocks
            if block.get("type") == "tool_use"
        ]
    except (KeyError, TypeError) as exc:
        raise ProviderError(
            f"{PROVIDER}: malformed reply ({type(exc).__name__}: {exc})",
            retryable=False,
            sent=True,
            status=200,
        ) from None
    return ModelReply(
        text=text,
        tool_calls=calls,
        usage=parse_usage(data.get("usage")),
        stop_reason=data.get("stop_reason") or "",
    )


def parse_input(raw: Any) -> dict:
    # The API always sends an object; anything else is kept for the platform's schema check.
    return raw if isinstance(raw, dict) else {"_raw": str(raw)}


def parse_usage(raw: Any) -> Usage:
    if not isinstance(raw, dict):
        return Usage()
    return Usage(
        input_tokens=raw.get("input_tokens") or 0,
        cached_input_tokens=raw.get("cache_read_input_tokens") or 0,
        cache_write_tokens=raw.get("cache_creation_input_tokens") or 0,
        output_tokens=raw.get("output_tokens") or 0,
    )
