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

Servers that speak this wire without all of it (LiteLLM's proxy in front of an OpenAI-compatible
server) are adapted by the endpoint's compat settings (llm/compat.py): `prompt_cache: none` sends
no cache_control at all, `system: string` sends the instructions as a plain string, and
`tool_results: user` sends calls and results as plain text. A refused request names the setting
to change (compat.anthropic_refusal_hint). Sampling defaults (temperature, top_p) go with every
request.

Streamed (the endpoint's default): the events are read as they come, output counted
(http.OutputMeter), and the connection closed once the call's output limit is reached. The
server's input count arrives first (message_start) and its output count last (message_delta);
an answer cut short keeps the server's input count and the platform's output count, marked
`counted_by: platform`.
"""

from __future__ import annotations

import json
from typing import Any

from llm.compat import Compat, anthropic_refusal_hint, tool_calls_text, tool_result_text
from llm.providers.http import OutputMeter, complete_call, make_client
from llm.tokens import estimate_input_tokens
from llm.types import Message, ModelReply, ModelRequest, ProviderError, ToolCall, ToolSpec, Usage

PROVIDER = "anthropic"
API_VERSION = "2023-06-01"
# Context editing (clearing old tool results on the server) is a beta behind this header.
CONTEXT_MANAGEMENT_BETA = "context-management-2025-06-27"
CLEAR_TOOL_USES = "clear_tool_uses_20250919"
_EPHEMERAL = {"type": "ephemeral"}


class AnthropicProvider:
    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        model: str,
        *,
        compat: Compat | None = None,
        sampling: dict[str, float] | None = None,
        stream: bool = False,
    ):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.compat = compat or Compat()
        self.sampling = dict(sampling or {})
        self.stream = stream
        self._api_key = api_key
        self._client = make_client()

    def __repr__(self) -> str:  # keep the key out of logs and tracebacks
        return f"AnthropicProvider(base_url={self.base_url!r}, model={self.model!r})"

    def close(self) -> None:
        self._client.close()

    def complete(self, request: ModelRequest) -> ModelReply:
        body = self.build_body(request)
        return complete_call(
            self._client,
            f"{self.base_url}/v1/messages",
            request,
            headers=self._headers(body),
            body=body,
            stream=self.stream,
            provider=PROVIDER,
            secret=self._api_key,
            parse_reply=parse_reply,
            streamed=StreamedAnswer,
            is_token=_is_token,
            refusal_hint=lambda detail: anthropic_refusal_hint(detail, body),
        )

    def build_body(self, request: ModelRequest) -> dict[str, Any]:
        cache = self.compat.prompt_cache == "blocks"
        wire = build_messages(request.messages, as_text=self.compat.tool_results == "user")
        body: dict[str, Any] = {
            # The request may pin a model; otherwise the provider's configured one is used.
            "model": request.model or self.model,
            "max_tokens": request.max_output_tokens,
            "messages": mark_conversation(wire) if cache else wire,
        }
        if request.instructions:  # the API rejects empty text blocks
            if self.compat.system == "string":
                body["system"] = request.instructions
            else:
                block: dict[str, Any] = {"type": "text", "text": request.instructions}
                if cache:
                    block["cache_control"] = _EPHEMERAL
                body["system"] = [block]
        if request.tools:
            body["tools"] = build_tools(request.tools, cache=cache)
        body.update(self.sampling)
        if self.stream:
            body["stream"] = True
        if request.clear_tool_uses and self.compat.context_editing == "clear_tool_uses":
            body["context_management"] = {"edits": [clear_edit(request.clear_tool_uses)]}
        return body

    def _headers(self, body: dict[str, Any] | None = None) -> dict[str, str]:
        headers = {"anthropic-version": API_VERSION}
        if body is not None and "context_management" in body:
            headers["anthropic-beta"] = CONTEXT_MANAGEMENT_BETA
        if self._api_key:
            headers["x-api-key"] = self._api_key
        return headers


def clear_edit(settings: dict[str, int]) -> dict[str, Any]:
    """The clear_tool_uses edit: past `trigger` input tokens the server replaces every tool
    result but the newest `keep` with a placeholder, if that clears at least `clear_at_least`."""
    edit: dict[str, Any] = {
        "type": CLEAR_TOOL_USES,
        "trigger": {"type": "input_tokens", "value": settings["trigger"]},
        "keep": {"type": "tool_uses", "value": settings["keep"]},
    }
    if settings.get("clear_at_least"):
        edit["clear_at_least"] = {"type": "input_tokens", "value": settings["clear_at_least"]}
    return edit


def _is_token(name: str, data: Any) -> bool:
    # Generation starts with the first content delta; message_start comes before any of it.
    return name == "content_block_delta" or (
        name == "" and isinstance(data, dict) and data.get("type") == "content_block_delta"
    )


def build_tools(tools: list[ToolSpec], *, cache: bool = True) -> list[dict[str, Any]]:
    wire: list[dict[str, Any]] = [
        {"name": tool.name, "description": tool.description, "input_schema": tool.input_schema}
        for tool in tools
    ]
    if cache:
        wire[-1]["cache_control"] = _EPHEMERAL
    return wire


def build_messages(messages: list[Message], *, as_text: bool = False) -> list[dict[str, Any]]:
    """Map turns to blocks, merging adjacent turns of the same wire role.

    Tool results travel as user turns, and the API wants every result for an assistant turn
    in the single user message that follows it (roles must alternate). `as_text`
    (`tool_results: user`): calls and results as text blocks instead of tool_use and tool_result.
    """
    names = {call.id: call.name for message in messages for call in message.tool_calls}
    wire: list[dict[str, Any]] = []
    for message in messages:
        role = "assistant" if message.role == "assistant" else "user"
        blocks = text_blocks(message, names) if as_text else message_blocks(message)
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


def text_blocks(message: Message, names: dict[str, str]) -> list[dict[str, Any]]:
    if message.role == "tool":
        return [{"type": "text", "text": tool_result_text(message, names.get(message.tool_call_id, ""))}]
    if message.role == "assistant" and message.tool_calls:
        return [{"type": "text", "text": tool_calls_text(message)}]
    return message_blocks(message)


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
    cleared_tokens, cleared_uses = parse_applied_edits(data.get("context_management"))
    return ModelReply(
        text=text,
        tool_calls=calls,
        usage=parse_usage(data.get("usage")),
        stop_reason=data.get("stop_reason") or "",
        cleared_input_tokens=cleared_tokens,
        cleared_tool_uses=cleared_uses,
    )


def parse_applied_edits(raw: Any) -> tuple[int, int]:
    """(input tokens, tool uses) the server's context editing cleared from the request."""
    edits = raw.get("applied_edits") if isinstance(raw, dict) else None
    if not isinstance(edits, list):
        return 0, 0
    tokens = uses = 0
    for edit in edits:
        if isinstance(edit, dict) and edit.get("type") == CLEAR_TOOL_USES:
            tokens += int(edit.get("cleared_input_tokens") or 0)
            uses += int(edit.get("cleared_tool_uses") or 0)
    return tokens, uses


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


class StreamedAnswer:
    """A Messages answer put together from its events: text and tool_use blocks by index (a
    tool's input arrives as pieces of JSON), the stop reason, and the server's usage (input in
    message_start, output in message_delta)."""

    def __init__(self, limit: int) -> None:
        self.meter = OutputMeter(limit)
        self.blocks: dict[int, dict[str, Any]] = {}
        self.stop = ""
        self.usage: dict[str, Any] = {}
        self.context_management: Any = None
        self.ended = False

    def add(self, data: Any) -> None:
        if not isinstance(data, dict):
            return
        kind = data.get("type")
        if kind == "error":
            error = data.get("error") or {}
            raise ProviderError(
                f"{PROVIDER}: the stream ended with an error: {error.get('type', '')}: {error.get('message', '')}",
                retryable=True,
                sent=True,
                status=200,
            )
        if kind == "message_start":
            self.usage.update((data.get("message") or {}).get("usage") or {})
        elif kind == "content_block_start":
            block = dict(data.get("content_block") or {})
            block["pieces"] = []
            self.blocks[data.get("index", len(self.blocks))] = block
            if block.get("type") == "tool_use":
                self.meter.add(block.get("name", ""))
        elif kind == "content_block_delta":
            delta = data.get("delta") or {}
            piece = delta.get("text") or delta.get("partial_json") or ""
            block = self.blocks.setdefault(data.get("index", 0), {"type": "text", "pieces": []})
            block["pieces"].append(piece)
            self.meter.add(piece)
        elif kind == "message_delta":
            self.stop = (data.get("delta") or {}).get("stop_reason") or self.stop
            self.usage.update(data.get("usage") or {})
            # The context editing applied to the request, reported with the message's end.
            self.context_management = data.get("context_management") or self.context_management
        elif kind == "message_stop":
            self.ended = True

    def reply(self, request: ModelRequest, *, cut: bool) -> ModelReply:
        text, calls = [], []
        for _, block in sorted(self.blocks.items()):
            joined = "".join(block["pieces"])
            if block.get("type") == "text":
                text.append(block.get("text", "") + joined)
            elif block.get("type") == "tool_use" and block.get("name"):
                arguments = block.get("input") if not joined else _parse_json(joined)
                calls.append(
                    ToolCall(id=block.get("id", ""), name=block["name"], arguments=parse_input(arguments))
                )
        if "output_tokens" in self.usage and self.ended and not cut:
            usage = parse_usage(self.usage)
        else:
            # The server's input count, if its first event came (it always does), and the
            # platform's count of the output it read.
            server = parse_usage(self.usage) if "input_tokens" in self.usage else None
            usage = Usage(
                input_tokens=server.input_tokens if server else estimate_input_tokens(request),
                cached_input_tokens=server.cached_input_tokens if server else 0,
                cache_write_tokens=server.cache_write_tokens if server else 0,
                output_tokens=self.meter.tokens,
                counted_by="platform",
            )
        cleared_tokens, cleared_uses = parse_applied_edits(self.context_management)
        return ModelReply(
            text="".join(text),
            tool_calls=calls,
            usage=usage,
            stop_reason="cut_at_output_limit" if cut else self.stop,
            cleared_input_tokens=cleared_tokens,
            cleared_tool_uses=cleared_uses,
        )


def _parse_json(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw  # cut short: kept raw for the platform's schema check (parse_input)
